"""HuggingFace transformers models of the zoo (GPT-2, BERT, Llama), built from configs only.

Nothing is downloaded: each model is ``XModel(XConfig(...))`` with random weights, which is all a memory
planner needs. ``transformers`` is imported inside the builders so that importing ``karma_fx.zoo`` stays cheap
and works where transformers is absent. Each builder returns ``args=()`` and ``kwargs`` with ``input_ids`` and
``labels`` so that calling the model returns an output whose ``.loss`` is the training loss.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from karma_fx.zoo._common import Request, ZooError, heads_for, positive_int, tokens


def _dropout(req: Request, default: float) -> float:
    value = float(req.opt("dropout", default))
    if not 0.0 <= value < 1.0:
        raise ZooError(f"dropout must be in [0, 1), got {value}")
    return value


def _pin_loss_function(model: nn.Module, loss_type: str) -> None:
    """Resolve the model's loss function now instead of on every forward.

    In transformers 5.x ``PreTrainedModel.loss_function`` is a property that looks ``self.loss_type`` up in
    ``LOSS_MAPPING``. ``loss_type`` is guessed from the class name in ``__init__``; for ``GPT2LMHeadModel`` no
    mapping key matches, so it is ``None`` and every forward calls ``logger.warning_once`` and falls back to
    the causal-LM loss. That logging call is what breaks a torch.compile/dynamo trace. Setting ``loss_type``
    fixes the lookup, and assigning the function itself (the property's setter stores ``_loss_function``,
    which the getter returns first) removes the lookup from the traced forward entirely.
    """
    from transformers.loss.loss_utils import LOSS_MAPPING

    model.loss_type = loss_type  # type: ignore[assignment]
    model.loss_function = LOSS_MAPPING[loss_type]  # type: ignore[assignment]


def _attention_dropout(req: Request, p: float) -> float:
    """``p`` where the caller set ``dropout`` or at tiny size; 0 at real size, the pretraining setting that
    lets SDPA run its fused kernel (dropout on the S x S probabilities forces the math path)."""
    return p if req.tiny or "dropout" in req.overrides else 0.0


def _lm_inputs(req: Request, vocab: int) -> dict[str, Any]:
    return {"input_ids": tokens(req, vocab), "labels": tokens(req, vocab)}


def build_gpt2(req: Request) -> tuple[nn.Module, tuple, dict]:
    """Real: GPT-2 small (12 layers, 768 hidden, 12 heads, vocab 50257, 1024 positions, ~124M). Tiny: 2 layers,
    64 hidden, 4 heads, vocab 256. Residual and embedding dropout keep GPT-2's default 0.1; attention dropout is
    0 at real size (the usual pretraining setting, which lets SDPA take its fused kernel: it saves O(S) per head,
    not the S x S probabilities) and 0.1 at tiny size (tests exercise dropout through attention).

    Overrides: ``layers``, ``hidden`` (heads follow head dim 64 real / 16 tiny), ``heads``, ``vocab``,
    ``dropout`` (sets resid/embd/attn dropout together). Positions = max(default, seq).
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    hidden = positive_int("hidden", req.opt("hidden", 64 if req.tiny else 768))
    default_heads = None if "hidden" in req.overrides else (4 if req.tiny else 12)
    vocab = positive_int("vocab", req.opt("vocab", 256 if req.tiny else 50257))
    p = _dropout(req, 0.1)
    assert req.seq is not None
    config = GPT2Config(
        vocab_size=vocab,
        n_positions=max(64 if req.tiny else 1024, req.seq),
        n_embd=hidden,
        n_layer=positive_int("layers", req.opt("layers", 2 if req.tiny else 12)),
        n_head=heads_for(hidden, req.opt("heads", default_heads), 16 if req.tiny else 64),
        resid_pdrop=p,
        embd_pdrop=p,
        attn_pdrop=_attention_dropout(req, p),
        bos_token_id=vocab - 1,  # GPT-2's <|endoftext|> is the last id; keep it inside a shrunken vocab
        eos_token_id=vocab - 1,
        use_cache=False,
        attn_implementation="sdpa",
    )
    model = GPT2LMHeadModel(config)
    _pin_loss_function(model, "ForCausalLM")
    return model, (), _lm_inputs(req, vocab)


def build_bert(req: Request) -> tuple[nn.Module, tuple, dict]:
    """Real: BERT-base (12 layers, 768 hidden, 12 heads, 3072 intermediate, vocab 30522, 512 positions, ~110M)
    with the masked-LM head. Tiny: 2 layers, 64 hidden, 4 heads, 256 intermediate, vocab 256. Hidden dropout
    keeps BERT's default 0.1; attention dropout is 0 at real size (fused SDPA, as for GPT-2), 0.1 at tiny size. No attention mask is passed (every position is a real token); labels cover every
    position, which costs the same as 15% masking for a planner since the logits are computed everywhere.

    Overrides: ``layers``, ``hidden`` (heads follow head dim 64 real / 16 tiny; intermediate = 4x hidden),
    ``heads``, ``intermediate``, ``vocab``, ``dropout``. Positions = max(default, seq).
    """
    from transformers import BertConfig, BertForMaskedLM

    hidden = positive_int("hidden", req.opt("hidden", 64 if req.tiny else 768))
    default_heads = None if "hidden" in req.overrides else (4 if req.tiny else 12)
    vocab = positive_int("vocab", req.opt("vocab", 256 if req.tiny else 30522))
    p = _dropout(req, 0.1)
    assert req.seq is not None
    config = BertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=positive_int("layers", req.opt("layers", 2 if req.tiny else 12)),
        num_attention_heads=heads_for(hidden, req.opt("heads", default_heads), 16 if req.tiny else 64),
        intermediate_size=positive_int("intermediate", req.opt("intermediate", 4 * hidden)),
        max_position_embeddings=max(64 if req.tiny else 512, req.seq),
        hidden_dropout_prob=p,
        attention_probs_dropout_prob=_attention_dropout(req, p),
        use_cache=False,
        attn_implementation="sdpa",
    )
    model = BertForMaskedLM(config)
    _pin_loss_function(model, "ForMaskedLM")
    return model, (), _lm_inputs(req, vocab)


def build_llama(req: Request) -> tuple[nn.Module, tuple, dict]:
    """Real: a Llama-3.2-1B-like shape with the Llama-2 vocabulary (hidden 2048, 16 layers, 32 heads, 8 KV
    heads, intermediate 8192, vocab 32000, untied head, ~1.1B). Tiny: 2 layers, 64 hidden, 4 heads, 2 KV heads,
    intermediate 128, vocab 256. Llama has no dropout by default; ``dropout`` sets ``attention_dropout``.

    Overrides: ``layers``, ``hidden`` (heads follow head dim 64 real / 16 tiny; intermediate = 4x hidden),
    ``heads``, ``kv_heads`` (default heads // 4 real, heads // 2 tiny), ``intermediate``, ``vocab``,
    ``dropout``. Positions (RoPE, no parameters) = max(default, seq).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden = positive_int("hidden", req.opt("hidden", 64 if req.tiny else 2048))
    default_heads = None if "hidden" in req.overrides else (4 if req.tiny else 32)
    heads = heads_for(hidden, req.opt("heads", default_heads), 16 if req.tiny else 64)
    kv_default = max(1, heads // (2 if req.tiny else 4))
    kv_heads = positive_int("kv_heads", req.opt("kv_heads", kv_default if heads % kv_default == 0 else heads))
    if heads % kv_heads:
        raise ZooError(f"heads={heads} is not divisible by kv_heads={kv_heads}")
    intermediate_default = 2 * hidden if req.tiny else 4 * hidden
    vocab = positive_int("vocab", req.opt("vocab", 256 if req.tiny else 32000))
    assert req.seq is not None
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=positive_int("intermediate", req.opt("intermediate", intermediate_default)),
        num_hidden_layers=positive_int("layers", req.opt("layers", 2 if req.tiny else 16)),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max(64 if req.tiny else 2048, req.seq),
        attention_dropout=_dropout(req, 0.0),
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config)
    _pin_loss_function(model, "ForCausalLM")
    return model, (), _lm_inputs(req, vocab)
