"""A load-aware draft length: TensorRT-LLM's `draft_len_schedule`, chosen from the cost model or
from measurements, with TensorRT-LLM's constraints enforced.

Semantics (TensorRT-LLM `get_draft_len_for_batch_size`, trtllm-integration.md §3, same as
`runtime.reference.draft_length`): the smallest key >= the live batch size gives the draft length,
so key k covers the band (previous key, k]; above the largest key speculation is off (0).
Constraints (`DecodingBaseConfig.validate_draft_len_schedule_and_sort`): keys >= 1, lengths >= 0,
every length <= max_draft_len, and the smallest key maps to max_draft_len exactly.

That last rule is reconciled by construction: the band with the smallest key is chosen first and
freely, and its length becomes the engine's max_draft_len (which may be below block_size - 1);
every later band picks the best length not above it. The cap only binds when a larger batch would
want longer drafts than a smaller one, which the cost of verifying b*(k+1) tokens makes rare; the
bands where it did bind are reported.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from ..checkpoints.hf import read_json
from ..errors import InputError
from .cost_model import CostModel
from .points import BenchPoint

Score = Callable[[int, int, int], float]  # (band low exclusive, band high inclusive, draft length) -> tokens/s


def model_score(model: CostModel) -> Score:
    """Mean predicted throughput over every batch size of the band."""
    def score(low: int, high: int, draft_len: int) -> float:
        return sum(model.tokens_per_s(b, draft_len) for b in range(low + 1, high + 1)) / (high - low)
    return score


def measured_score(points: Sequence[BenchPoint]) -> Score:
    """Measured throughput at the band's upper edge (its key); unmeasured lengths never win."""
    table = {(p.concurrency, p.draft_len): p.tokens_per_s for p in points}
    return lambda low, high, draft_len: table.get((high, draft_len), float("-inf"))


def best_length(score: Score, low: int, high: int, limit: int) -> int:
    """The highest-scoring draft length in 0..limit for the band (low, high]; ties go to the shorter."""
    return max(range(limit + 1), key=lambda k: score(low, high, k))


def choose_lengths(score: Score, keys: Sequence[int], most: int) -> tuple[dict[int, int], list[int]]:
    """Best draft length (0..most) per band ending at each key, capped by the first band's choice.
    -> (length per key, keys where the cap changed the choice)."""
    lengths: dict[int, int] = {}
    capped: list[int] = []
    low = 0
    for key in sorted(keys):
        free = best_length(score, low, key, most)
        lengths[key] = best_length(score, low, key, lengths[min(lengths)]) if lengths else free
        if lengths[key] != free:
            capped.append(key)
        low = key
    return lengths, capped


def canonical(lengths: dict[int, int]) -> dict[int, int]:
    """The same schedule with fewest keys: a key whose length equals the next key's is covered by
    it, and trailing zeros equal the implicit 'off above the largest key'. {} = never speculate."""
    keys = sorted(lengths)
    kept = {k: lengths[k] for k, nxt in zip(keys, keys[1:] + [None]) if nxt is None or lengths[nxt] != lengths[k]}
    while kept and kept[max(kept)] == 0:
        del kept[max(kept)]
    return kept


def check_schedule(schedule: dict[int, int], max_draft_len: int | None = None, path: str | Path | None = None) -> None:
    """TensorRT-LLM's validation, as InputError naming the file and field."""
    field = "schedule.draft_len_schedule"
    for key, length in schedule.items():
        if key < 1 or length < 0:
            raise InputError(f"batch sizes must be >= 1 and draft lengths >= 0, got {key}: {length}.",
                             path=path, field=field)
    if not schedule:
        return
    first = schedule[min(schedule)]
    most = first if max_draft_len is None else max_draft_len
    if first != most:
        raise InputError(f"the smallest batch size ({min(schedule)}) must map to max_draft_len ({most}), "
                         f"got {first}.", path=path, field=field)
    if max(schedule.values()) > most:
        raise InputError(f"every draft length must be <= max_draft_len ({most}).", path=path, field=field)


def build_schedule(score: Score, keys: Sequence[int], most: int, source: str) -> dict:
    """The bench JSON's `schedule` section."""
    lengths, capped = choose_lengths(score, keys, most)
    schedule = canonical(lengths)
    check_schedule(schedule)
    return {"draft_len_schedule": {str(k): v for k, v in schedule.items()},
            "max_draft_len": schedule[min(schedule)] if schedule else 0,
            "best_per_band": {str(k): v for k, v in lengths.items()},
            "capped_bands": capped, "source": source,
            "semantics": "smallest key >= live batch size gives the draft length; 0 above the largest key; "
                         "{} = speculation never paid off (build without speculation)"}


def schedule_from_bench(path: str | Path) -> dict[int, int]:
    """The draft_len_schedule a dflash-bench JSON recommends, keys as ints, validated for TensorRT-LLM.
    Its max_draft_len is the value of the smallest key; {} means build without speculation. A bench
    that found its effect within the noise recommends none, and says why. Where it was measured
    (in-process or a server, and on which device) is the file's `measured_on`."""
    path = Path(path)
    section = read_json(path).get("schedule")
    if isinstance(section, dict) and section.get("recommended") is False:
        raise InputError(f"this bench did not recommend a schedule: {section.get('reason', 'no reason given')}.",
                         path=path, field="schedule.recommended")
    if not isinstance(section, dict) or not isinstance(section.get("draft_len_schedule"), dict):
        raise InputError("no schedule in this file; is it a dflash-bench JSON?", path=path,
                         field="schedule.draft_len_schedule")
    raw, most = section["draft_len_schedule"], section.get("max_draft_len")
    if not all(key.strip().isdigit() and type(value) is int for key, value in raw.items()):
        raise InputError(f"expected integer batch sizes mapped to integer draft lengths, got {raw}.", path=path,
                         field="schedule.draft_len_schedule")
    schedule = dict(sorted((int(key), value) for key, value in raw.items()))
    if schedule and type(most) is not int:
        raise InputError(f"expected an integer, got {most!r}.", path=path, field="schedule.max_draft_len")
    check_schedule(schedule, most if schedule else None, path)
    return schedule


def measured_on(path: str | Path) -> dict[str, str] | None:
    """{'machine', 'device'} of the dflash-bench run that wrote `path`, or None when it does not say."""
    document = read_json(Path(path))
    machine, device = document.get("machine"), document.get("device")
    return {"machine": machine, "device": device} if isinstance(machine, str) and isinstance(device, str) else None
