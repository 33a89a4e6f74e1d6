"""What the decoding tests compare runs with: SmolLM2's shape, and where two runs part."""

from __future__ import annotations

#: SmolLM2-135M's configuration (its shapes; the tests' weights are random)
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                    tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0, bos_token_id=1, eos_token_id=2,
                    pad_token_id=0)


def parting(run, other) -> list[tuple[int, float]]:
    """Per row of each turn (a run: per turn ``(tokens, log_probs, ...)``, each per row): how many tokens the two
    runs share before they part, and the largest change of a log-probability over those. A row that parted in a
    turn shares nothing in its later turns: their contexts differ from there (a sampled run's later turns read
    other tokens), so their log-probabilities are not the same quantity."""
    shared, parted = [], set()
    for (tokens, log_probs, *_), (other_tokens, other_log_probs, *_) in zip(run, other, strict=True):
        rows = zip(tokens, other_tokens, log_probs, other_log_probs, strict=True)
        for index, (row, other_row, logs, other_logs) in enumerate(rows):
            if index in parted:
                shared.append((0, 0.0))
                continue
            same = next((i for i, (a, b) in enumerate(zip(row, other_row, strict=False)) if a != b), min(len(row), len(other_row)))
            shared.append((same, max((abs(a - b) for a, b in zip(logs[:same], other_logs[:same], strict=True)), default=0.0)))
            if same < max(len(row), len(other_row)):
                parted.add(index)
    return shared
