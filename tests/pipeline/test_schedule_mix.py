"""interleave(weights=Schedule(...)): the realised mix follows the schedule over
the global position, exactly on resume and on another number of readers."""

from __future__ import annotations

import json

import numpy as np
import pytest
from torch.utils.data import DataLoader

import shardkit
from shardkit import Schedule
from shardkit.pipeline import PipelineError, mixture_shares
from shardkit.state import StateError, merge, merge_ranks

SIZE = 40_000  # per source: far more than any test reads, so no source runs out


class Items:
    """A map-style dataset of ``{"src": s, "i": i, "input_ids": [s] * length(i)}``."""

    def __init__(self, source: int, size: int = SIZE, tokens: bool = False) -> None:
        self.source, self.size, self.tokens = source, size, tokens

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict:
        length = 1 + (i * 7 + self.source * 3) % 9 if self.tokens else 1
        return {"src": self.source, "i": i, "input_ids": [self.source] * length}


def mix(schedule, *, rank=None, world_size=None, seed=5, tokens=False, sizes=(SIZE, SIZE)):
    sources = [shardkit.wrap(Items(s, n, tokens), rank=rank, world_size=world_size) for s, n in enumerate(sizes)]
    return shardkit.interleave(sources, weights=schedule, seed=seed)


def take(iterator, count):
    return [next(iterator) for _ in range(count)]


def window_errors(sources, schedule, window=2000, units=None, start=0):
    """Largest gap between the realised share of source 1 and the schedule's,
    over consecutive windows of ``window`` positions of the global stream."""
    units = np.ones(len(sources)) if units is None else np.asarray(units, dtype=float)
    positions = start + np.concatenate([[0], np.cumsum(units)[:-1]])
    errors = []
    for begin in range(0, int(positions[-1]) - window + 1, window):
        inside = (positions >= start + begin) & (positions < start + begin + window)
        realised = units[inside][np.asarray(sources)[inside] == 1].sum() / units[inside].sum()
        middle = start + begin + window / 2
        errors.append(abs(realised - schedule.weights_at(middle)[1]))
    return max(errors)


SCHEDULE = Schedule([(0, [0.9, 0.1]), (10_000, [0.5, 0.5]), (16_000, [0.2, 0.8])])


def iter_take(pipeline, count):
    return take(iter(pipeline), count)


def test_every_window_of_2000_samples_is_within_three_hundredths_of_the_schedule():
    samples = iter_take(mix(SCHEDULE), 20_000)
    assert window_errors([s["src"] for s in samples], SCHEDULE) <= 0.03


def test_the_schedule_follows_the_global_position_over_ranks_and_workers():
    """Two ranks of two workers: each reader counts its own samples times four,
    so the stream all four yield together follows the schedule."""
    loaders = [iter(DataLoader(mix(SCHEDULE, rank=r, world_size=2), batch_size=None, num_workers=2)) for r in (0, 1)]
    merged = []
    for _ in range(5_000):  # workers alternate within a rank; the ranks step together
        merged.extend(next(loader)["src"] for loader in loaders)
    assert window_errors(merged, SCHEDULE) <= 0.03


def test_a_token_schedule_counts_the_tokens_of_its_key():
    schedule = Schedule([(0, [0.9, 0.1]), (30_000, [0.3, 0.7])], unit="tokens")
    samples = iter_take(mix(schedule, tokens=True), 12_000)
    units = [len(s["input_ids"]) for s in samples]
    assert sum(units) > 40_000
    assert window_errors([s["src"] for s in samples], schedule, window=4000, units=units) <= 0.03
    by_sample = window_errors([s["src"] for s in samples], schedule, window=2000)
    assert by_sample > 0.03  # counted per sample it would not follow: long samples of source 1 weigh more


def test_a_resumed_mix_continues_exactly_where_the_saved_one_stopped():
    pipeline = mix(SCHEDULE)
    iterator = iter(pipeline)
    take(iterator, 3_000)
    state = json.loads(json.dumps(iterator.state_dict()))
    rest = take(iterator, 4_000)
    again = mix(SCHEDULE)
    again.load_state_dict(state)
    assert take(iter(again), 4_000) == rest


def test_a_mix_resumed_on_more_readers_continues_the_schedule_from_the_global_position():
    """Saved by one reader after 9,000 samples (weight of source 1 about 0.46 there),
    resumed by two workers: the first window after the resume follows the schedule
    at 9,000 on, not at 0 (0.1) again, and no sample is read twice."""
    pipeline = mix(SCHEDULE)
    iterator = iter(pipeline)
    before = take(iterator, 9_000)
    state = merge([iterator.state_dict()])
    resumed = mix(SCHEDULE)
    resumed.load_state_dict(state)
    after = take(iter(DataLoader(resumed, batch_size=None, num_workers=2)), 6_000)
    assert window_errors([s["src"] for s in after], SCHEDULE, start=9_000) <= 0.03
    seen = [(s["src"], s["i"]) for s in before + after]
    assert len(seen) == len(set(seen))


def test_mixture_shares_report_the_realised_and_the_scheduled_share_of_each_source():
    pipeline = mix(SCHEDULE)
    iterator = iter(pipeline)
    samples = take(iterator, 12_000)
    report = mixture_shares(iterator.state_dict())
    realised = np.mean([s["src"] for s in samples])
    assert report["units"] == 12_000
    assert report["realised"][1] == pytest.approx(realised)
    assert report["scheduled"][1] == pytest.approx(realised, abs=0.005)
    plain = iter(shardkit.wrap([1, 2]))
    next(plain)
    assert mixture_shares(plain.state_dict()) is None


def test_a_schedule_for_another_number_of_sources_is_refused():
    with pytest.raises(PipelineError, match="2 datasets but the Schedule weighs 3"):
        shardkit.interleave([shardkit.wrap([1]), shardkit.wrap([2])], weights=Schedule([(0, [1, 1, 1])]))


def test_a_state_saved_under_another_schedule_is_refused_naming_it():
    iterator = iter(mix(SCHEDULE))
    take(iterator, 10)
    other = mix(Schedule([(0, [0.5, 0.5])]))
    with pytest.raises(StateError, match="saved under another schedule"):
        other.load_state_dict(iterator.state_dict())
    plain = shardkit.interleave([shardkit.wrap(Items(0)), shardkit.wrap(Items(1))], seed=5)
    with pytest.raises(StateError, match="with a Schedule, this one has none"):
        plain.load_state_dict(iterator.state_dict())


def test_a_tampered_schedule_position_is_a_state_error_naming_the_field():
    iterator = iter(mix(SCHEDULE))
    take(iterator, 10)
    state = iterator.state_dict()
    state["schedule"]["realised"] = [1, -4]
    with pytest.raises(StateError, match=r"state\['schedule'\]\['realised'\] must be 2 numbers >= 0"):
        mix(SCHEDULE).load_state_dict(state)


def test_a_token_schedule_over_samples_without_the_key_names_the_key():
    schedule = Schedule([(0, [1, 1])], unit="tokens", key="tokens")
    with pytest.raises(Exception, match="counts the tokens of 'tokens'"):
        iter_take(mix(schedule), 1)


@pytest.mark.parametrize("new_world", [1, 3])
def test_a_mix_saved_on_two_ranks_resumes_on_another_world_from_the_position_all_had_reached(new_world):
    """Two ranks read 3,000 samples each and gather; 1 or 3 ranks go on: no sample
    twice, and the first windows follow the schedule at 6,000 on (0.46 for source 1)."""
    iterators = [iter(mix(SCHEDULE, rank=r, world_size=2)) for r in (0, 1)]
    before = [s for it in iterators for s in take(it, 3_000)]
    state = json.loads(json.dumps(merge_ranks([it.state_dict() for it in iterators])))
    resumed = []
    for rank in range(new_world):
        pipeline = mix(SCHEDULE, rank=rank, world_size=new_world)
        pipeline.load_state_dict(state)
        resumed.append(take(iter(pipeline), 6_000 // new_world))
    seen = [(s["src"], s["i"]) for s in before + [s for part in resumed for s in part]]
    assert len(seen) == len(set(seen))
    in_step = [s["src"] for group in zip(*resumed) for s in group]  # the ranks step together
    assert window_errors(in_step, SCHEDULE, start=6_000) <= 0.03
    assert mixture_shares(state)["units"] == 6_000


@pytest.mark.parametrize("new_world", [1, 3])
def test_a_scheduled_packed_mix_saved_on_two_ranks_packs_every_token_once_on_another_world(new_world):
    """interleave(Schedule).pack(32) over 2 ranks, gathered mid-epoch, read to the end on 1 or 3
    ranks: every token of every document comes exactly once (pad repeats none: balance='none')."""
    schedule = Schedule([(0, [0.8, 0.2]), (400, [0.3, 0.7])], unit="tokens")

    def packed(rank, world):
        sources = [
            shardkit.wrap(Items(s, 150, tokens=True), rank=rank, world_size=world, balance="none") for s in (0, 1)
        ]
        mixed = shardkit.interleave(sources, weights=schedule, seed=1, stop="all_exhausted")
        return mixed.map(numbered).pack(32, strategy="concat", pad_id=-7)

    iterators = [iter(packed(r, 2)) for r in (0, 1)]
    blocks = [b for it in iterators for b in take(it, 6)]
    state = json.loads(json.dumps(merge_ranks([it.state_dict() for it in iterators])))
    for rank in range(new_world):
        pipeline = packed(rank, new_world)
        pipeline.load_state_dict(state)
        blocks.extend(pipeline)
    tokens = np.concatenate([b["input_ids"].numpy() for b in blocks])
    tokens = tokens[tokens != -7]
    expected = [numbered(Items(s, 150, tokens=True)[i])["input_ids"] for s in (0, 1) for i in range(150)]
    assert sorted(tokens.tolist()) == sorted(np.concatenate(expected).tolist())


def numbered(sample: dict) -> dict:
    """Tokens that name their document and place, so every token is told apart."""
    base = (sample["src"] * 1_000 + sample["i"]) * 1_000
    return {"input_ids": np.arange(base, base + len(sample["input_ids"]), dtype=np.int64)}


@pytest.mark.parametrize("huge", [1e308, 1.7976931348623157e308])
@pytest.mark.parametrize("scheduled", [False, True], ids=["fixed", "scheduled"])
def test_huge_equal_weights_mix_both_sources_evenly(huge, scheduled):
    weights = Schedule([(0, [huge, huge]), (100, [huge, huge])]) if scheduled else [huge, huge]
    sources = [sample["src"] for sample in iter_take(mix(weights), 2000)]
    assert abs(sources.count(1) - 1000) <= 20  # evenly: the sum overflowed to inf, and every draw was source 1


def test_subnormal_equal_weights_mix_both_sources_evenly():
    sources = [sample["src"] for sample in iter_take(mix([5e-324, 5e-324]), 2000)]
    assert abs(sources.count(1) - 1000) <= 60  # was 1504: u * 1e-323 rounds to one of three values


def test_huge_weights_mix_like_the_same_ratio_at_ordinary_scale():
    ordinary = [sample["src"] for sample in iter_take(mix([3.0, 1.0]), 500)]
    assert [sample["src"] for sample in iter_take(mix([3e307, 1e307]), 500)] == ordinary


def test_mixture_shares_of_a_huge_scheduled_mix_are_finite_and_even():
    pipeline = mix(Schedule([(0, [1e308, 1e308])]))
    iterator = iter(pipeline)
    take(iterator, 400)
    report = mixture_shares(iterator.state_dict())
    assert report["scheduled"] == pytest.approx([0.5, 0.5])
