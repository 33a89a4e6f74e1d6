"""The base model: a configured Hugging Face model directory, or a tiny Qwen3 built from scratch.

A real user points ``base_model.path`` at a local HF directory (e.g. Qwen3-8B); it is validated
(config and tokenizer load, a chat template exists) and passed through. Without a path, the
embedded default builds one: a byte-level BPE tokenizer trained on the corpus
(:mod:`spader_pipeline.modeling.tokenizer`) and a randomly initialised ``Qwen3ForCausalLM`` of a
few million parameters — the same architecture family as Qwen3-8B, so every later stage (warm
start, native RL, evaluation, VERL) runs one code path for both.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from spader_pipeline.modeling.tokenizer import train_tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TinyQwen3Spec:
    """Size of the from-scratch model (defaults: ~5.5M parameters with an 8k vocabulary)."""

    hidden_size: int = 256
    """width of the residual stream"""
    num_hidden_layers: int = 4
    """number of decoder blocks"""
    num_attention_heads: int = 4
    """query heads per block"""
    num_key_value_heads: int = 4
    """key/value heads per block (< num_attention_heads gives grouped-query attention)"""
    intermediate_size: int = 768
    """width of the SwiGLU MLP"""
    max_position_embeddings: int = 4096
    """longest context the rotary embedding is configured for"""
    rope_theta: float = 10000.0
    """rotary base frequency"""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be divisible by num_attention_heads={self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")


def build_tiny_qwen3(tokenizer, spec: TinyQwen3Spec, *, seed: int = 0) -> Qwen3ForCausalLM:
    """A randomly initialised ``Qwen3ForCausalLM`` sized by ``spec`` for ``tokenizer``.

    Embeddings are tied to the output layer (as in the small Qwen3 models); ``eos_token_id`` is
    ``<|im_end|>`` so generation stops at the end of an assistant turn.
    """
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.hidden_size // spec.num_attention_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_theta": spec.rope_theta, "rope_type": "default"},
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def build_base_model(
    texts: Iterable[str],
    output_dir: str | Path,
    *,
    spec: TinyQwen3Spec | None = None,
    vocab_size: int = 8192,
    min_frequency: int = 2,
    seed: int = 0,
) -> Path:
    """Train a tokenizer on ``texts``, build the tiny model, save both to ``output_dir``."""
    output_dir = Path(output_dir)
    tokenizer = train_tokenizer(texts, vocab_size=vocab_size, min_frequency=min_frequency)
    model = build_tiny_qwen3(tokenizer, spec or TinyQwen3Spec(), seed=seed)
    output_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    logger.info("built tiny Qwen3 (%.2fM parameters) in %s", count_parameters(model) / 1e6, output_dir)
    return output_dir


#: Weight formats that are pickles: loading one can run code, so they are refused (docs/reliability.md).
PICKLED_WEIGHTS = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


def check_safe_weights(path: str | Path) -> None:
    """Refuse a model folder whose weights are not all safetensors (pickled weights can run code).

    Every model the project loads from a path (``base_model.path``, merged checkpoints, evaluated or
    served folders) goes through here; configs and tokenizers load with ``trust_remote_code=False``.
    """
    path = Path(path)
    if not path.is_dir():
        return  # a missing folder gets its own error from the loader
    pickled = sorted(p.name for p in path.iterdir() if p.suffix in PICKLED_WEIGHTS and p.is_file())
    if pickled and not any(path.glob("*.safetensors")):
        raise ValueError(
            f"{path} holds pickled weights ({', '.join(pickled)}), which can run code when loaded; "
            "convert them to safetensors (model.save_pretrained(out, safe_serialization=True) where "
            "you trust the files) and point the configuration at the converted folder"
        )


def validate_model_dir(path: str | Path) -> dict[str, object]:
    """Check that ``path`` is a usable HF causal-LM directory; return a short description.

    Loads only the config and the tokenizer (not the weights), so it is cheap even for 8B models.
    Raises ``FileNotFoundError``/``ValueError`` with a message that says what is missing.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"base_model.path={path} is not a Hugging Face model directory (no config.json)")
    check_safe_weights(path)
    config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    if not tokenizer.chat_template:
        raise ValueError(f"the tokenizer in {path} has no chat template; the agent needs one")
    return {
        "model_type": config.model_type,
        "vocab_size": len(tokenizer),
        "architectures": list(config.architectures or []),
    }


def load_model_and_tokenizer(path: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """Load an HF causal LM and its tokenizer (left padding, pad token set; on CPU grouped-query
    models use :mod:`spader_pipeline.modeling.attention`). Safetensors weights only, no remote code
    (:func:`check_safe_weights`)."""
    check_safe_weights(path)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True,
                                                 trust_remote_code=False).to(device)
    if torch.device(device).type == "cpu":
        from spader_pipeline.modeling.attention import use_gqa_attention

        use_gqa_attention(model)  # grouped-query models: no KV-cache copies per decoding step
    return model, tokenizer


def train_top_layers(model: torch.nn.Module, layers: int | None) -> list[torch.nn.Parameter]:
    """Make only the top ``layers`` decoder blocks and the final norm trainable; return those parameters.

    ``layers=None`` (or at least the model's depth) trains everything. Freezing the embeddings and
    the lower blocks means autograd records nothing below the first trainable block, so a backward
    pass costs a fraction of a full one (and the frozen blocks keep no activations). Tied input
    and output embeddings stay frozen with the rest.
    """
    blocks = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or blocks is None or layers >= len(blocks):
        for p in model.parameters():
            p.requires_grad_(True)
        return [p for p in model.parameters()]
    if layers < 1:
        raise ValueError(f"trainable_layers={layers} must be >= 1 (or null for all)")
    model.requires_grad_(False)
    trainable = list(blocks[len(blocks) - layers :])
    norm = getattr(model.model, "norm", None)
    if norm is not None:
        trainable.append(norm)
    for module in trainable:
        module.requires_grad_(True)
    return [p for p in model.parameters() if p.requires_grad]


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
