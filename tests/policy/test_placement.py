"""Placement over several engines: prefix affinity first, load otherwise, no engine starved."""

from __future__ import annotations

import pytest

from tinyloop.policy.placement import Placement, Room

SALT = (4, 4)  # loops, window


def rooms(*free: int, blocks: tuple[int | None, ...] | None = None) -> list[Room]:
    return [Room(i, f, None if blocks is None else blocks[i]) for i, f in enumerate(free)]


def prompt(tag: int, blocks: int, size: int = 4) -> list[int]:
    return [tag * 1000 + i for i in range(blocks * size)]


def test_an_unseen_prompt_goes_to_the_least_loaded_engine() -> None:
    p = Placement(3, block_size=4)
    assert p.choose(prompt(1, 2), SALT, rooms(2, 5, 3)) == 1
    assert p.choose(prompt(2, 2), SALT, rooms(4, 4, 4, blocks=(1, 9, 3))) == 1  # then KV headroom
    assert p.choose(prompt(3, 2), SALT, rooms(4, 4, 4)) == 0  # then the lowest index
    assert p.statistics().by_prefix == 0


def test_a_prompt_that_extends_an_earlier_one_follows_it() -> None:
    p = Placement(3, block_size=4)
    first = prompt(1, 3)
    assert p.choose(first, SALT, rooms(1, 8, 8)) == 1
    turn2 = first + [7, 7, 7, 7, 8, 8]  # the next turn of the conversation
    assert p.choose(turn2, SALT, rooms(8, 7, 8)) == 1  # even with engine 0 as free
    assert p.matches(p.keys(turn2, SALT)) == {1: 4}
    assert p.statistics().by_prefix == 1


def test_the_longest_match_wins() -> None:
    p = Placement(2, block_size=4)
    base = prompt(1, 2)
    assert p.choose(base, SALT, rooms(8, 7)) == 0
    longer = base + prompt(2, 2)
    assert p.choose(longer, SALT, rooms(7, 8)) == 0  # shares two blocks with engine 0's
    registered = {1: len(longer) + 4}  # engine 1's prefix pool holds a longer prefix
    assert p.choose(longer + prompt(3, 1) + [5], SALT, rooms(8, 8), registered=registered) == 1


def test_salt_separates_loops() -> None:
    p = Placement(2, block_size=4)
    assert p.choose(prompt(1, 2), (4, 4), rooms(8, 7)) == 0
    assert p.choose(prompt(1, 2), (8, 8), rooms(7, 8)) == 1  # same tokens, other loops: no match


def test_a_full_engine_or_one_far_busier_loses_its_prefix_requests() -> None:
    p = Placement(2, block_size=4, slack=2)
    conv = prompt(1, 2)
    assert p.choose(conv, SALT, rooms(8, 7)) == 0
    assert p.choose(conv, SALT, rooms(0, 8)) == 1  # no room on 0
    q = Placement(2, block_size=4, slack=2)
    assert q.choose(conv, SALT, rooms(8, 7)) == 0
    assert q.choose(conv, SALT, rooms(6, 8)) == 0  # 2 busier than engine 1: the prefix wins
    assert q.choose(conv, SALT, rooms(5, 8)) == 1  # 3 busier: past the slack
    assert q.choose(conv, SALT, rooms(5, 7)) == 1  # now both hold it: the less loaded one


def test_a_shared_system_prompt_spreads_over_every_engine() -> None:
    p = Placement(2, block_size=4, slack=2)
    system = prompt(9, 2)
    free = [8, 8]
    for conv in range(8):  # eight conversations start at once, each holding its slot
        engine = p.choose(system + prompt(conv, 1), SALT, rooms(*free))
        free[engine] -= 1
    assert free == [4, 4]


def test_a_broken_engine_is_forgotten() -> None:
    p = Placement(2, block_size=4)
    conv = prompt(1, 2)
    assert p.choose(conv, SALT, rooms(8, 7)) == 0
    p.forget_engine(0)
    assert p.matches(p.keys(conv, SALT)) == {}
    assert p.choose(conv, SALT, [Room(1, 8)]) == 1


def test_the_memory_is_bounded_oldest_first() -> None:
    p = Placement(2, block_size=4, capacity=4)
    first = prompt(1, 2)
    p.choose(first, SALT, rooms(8, 8))
    p.choose(prompt(2, 2), SALT, rooms(8, 8))
    assert p.matches(p.keys(first, SALT)) == {0: 2}
    p.choose(prompt(3, 2), SALT, rooms(8, 8))  # two more blocks push the oldest two out
    assert p.matches(p.keys(first, SALT)) == {}
    assert p.statistics().remembered_blocks == 4


def test_partial_blocks_and_one_engine_remember_nothing() -> None:
    p = Placement(2, block_size=4)
    assert p.keys([1, 2, 3], SALT) == []
    single = Placement(1, block_size=4)
    assert single.choose(prompt(1, 4), SALT, rooms(8)) == 0
    assert single.statistics().remembered_blocks == 0


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        Placement(0, block_size=4)
    with pytest.raises(ValueError):
        Placement(2, block_size=4, slack=-1)
