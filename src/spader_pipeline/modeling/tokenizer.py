"""A byte-level BPE tokenizer trained on the corpus, with the agent protocol's tags as whole tokens.

No pretrained causal LM can be downloaded for the embedded default, so the tokenizer is trained
here with the ``tokenizers`` library, the same way Qwen's is built (byte-level BPE), just small:

- chat markers ``<|im_start|>``, ``<|im_end|>`` and ``<|endoftext|>`` are *special* tokens
  (dropped by ``decode(..., skip_special_tokens=True)``);
- the protocol tags (``<think>``, ``<tool_call>``, ``<answer>``, ``<tool_response>`` and their
  closing forms) are *added, non-special* tokens, as in Qwen3: each is one token, and decoding
  with ``skip_special_tokens=True`` keeps them, which the reward and the parser need.

The result is a ``transformers`` fast tokenizer with a Qwen3-style chat template
(``chat_template.jinja`` next to this file), loadable with ``AutoTokenizer.from_pretrained``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from importlib import resources

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)
PROTOCOL_TOKENS = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<answer>",
    "</answer>",
)


def chat_template() -> str:
    """The Qwen3-style chat template shipped with the package (Jinja source)."""
    return resources.files("spader_pipeline.modeling").joinpath("chat_template.jinja").read_text()


def train_tokenizer(
    texts: Iterable[str], *, vocab_size: int = 8192, min_frequency: int = 2
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts`` and wrap it for ``transformers``.

    Args:
        texts: training text (corpus passages, prompt templates); streamed once.
        vocab_size: total vocabulary size including special and protocol tokens.
        min_frequency: minimum pair count for a merge.

    Returns:
        A fast tokenizer with ``eos_token = <|im_end|>``, ``pad_token = <|endoftext|>`` and the
        chat template set. Every byte is representable, so nothing maps to an unknown token.
    """
    if vocab_size < 300:
        raise ValueError(f"vocab_size={vocab_size} is too small for a byte-level BPE (needs > 256 + specials)")
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(PROTOCOL_TOKENS),
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(_nonempty(texts), trainer=trainer)
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in PROTOCOL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=None,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=chat_template(),
        padding_side="left",
        model_max_length=32768,
    )


def _nonempty(texts: Iterable[str]) -> Iterator[str]:
    for text in texts:
        if text:
            yield text
