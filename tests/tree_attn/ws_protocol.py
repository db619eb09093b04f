"""The synchronisation of the "ws" kernel (tree_attn/csrc/tree_attn_ws.cu), restated and run under random
interleavings: the producer's loads and the consumers' loops as generators of barrier operations, a scheduler that
runs whichever warpgroup can go on, and a check that every run ends (no warpgroup waits forever), that every stage is
refilled only after its consumers released it, and that no named-barrier generation completes without a waiter.

mbarriers as the PTX ISA defines them: an expected count, the arrivals left in the current phase, the number of
completed phases k; `try_wait.parity p` succeeds when k's parity differs from p (the phase of parity p completed).
cp.async's `mbarrier.arrive.noinc` is modelled as arriving when the copies land, at a random later step. Named
barriers (`bar.sync` / `bar.arrive` with 256 threads): a generation completes when 256 threads arrived; a warpgroup
is 128 threads, and a lane-0-per-warp arrival on an mbarrier is 4 arrivals of a warpgroup.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class MBarrier:
    count: int
    left: int = 0
    phases: int = 0

    def __post_init__(self):
        self.left = self.count

    def arrive(self, n: int) -> None:
        assert n <= self.left, f"{n} arrivals on a phase with {self.left} left (more arrivals than the count)"
        self.left -= n
        if self.left == 0:
            self.phases += 1
            self.left = self.count

    def passed(self, parity: int) -> bool:
        return (self.phases & 1) != parity


@dataclass
class Named:
    threads: int = 0
    waiting: set = field(default_factory=set)
    generation: int = 0


def stage_of(b, S, halves):
    """(stage, use of that stage) of block b (tree_attn_ws.cu's stage_of)."""
    if halves:
        h, i = S // 2, b // 2
        return (b % 2) + 2 * (i % h), i // h
    return b % S, b // S


def producer(nb, S, kv_ahead, halves):
    yield ("cp_arrive", "q", 128)
    def load(b, v):
        s, u = stage_of(b, S, halves)
        if u > 0:
            yield ("wait", f"empty_{v}{s}", (u + 1) & 1)
        yield ("fill", (v, s, b))
        yield ("cp_arrive", f"full_{v}{s}", 128)
    if kv_ahead:
        if nb > 0:
            yield from load(0, "k")
        for b in range(nb):
            if b + 1 < nb:
                yield from load(b + 1, "k")
            yield from load(b, "v")
    else:
        for b in range(nb):
            yield from load(b, "k")
            yield from load(b, "v")


def consumer(w, nb, S, halves, pingpong, overlap=False):
    b0, step = (w, 2) if halves else (0, 1)
    if pingpong and w == 1 and not halves:
        yield ("bar_arrive", 1)  # turn_pass(1): barrier 2 - w

    def score(b):  # wait K, read it (the S wgmma), the turns
        s, u = stage_of(b, S, halves)
        yield ("wait", f"full_k{s}", u & 1)
        if pingpong and not halves:
            yield ("bar_sync", 1 + w)
        yield ("read", ("k", s, b))
        if pingpong and not halves and (w == 0 or b + 1 < nb):
            yield ("bar_arrive", 2 - w)

    def pv(b):
        s, u = stage_of(b, S, halves)
        yield ("wait", f"full_v{s}", u & 1)
        yield ("read", ("v", s, b))

    def release(b, v):
        yield ("arrive", f"empty_{v}{stage_of(b, S, halves)[0]}", 4)

    yield ("wait", "q", 0)
    blocks = list(range(b0, nb, step))
    if overlap and blocks:
        yield from score(blocks[0])
        yield from release(blocks[0], "k")
        for prev, b in zip(blocks, blocks[1:]):
            yield from score(b)
            yield from pv(prev)
            yield from release(b, "k")
            yield from release(prev, "v")
        yield from pv(blocks[-1])
        yield from release(blocks[-1], "v")
    elif not overlap:
        for b in blocks:
            yield from score(b)
            yield from release(b, "k")
            yield from pv(b)
            yield from release(b, "v")
    if halves:
        yield ("bar_sync", 3)
        yield ("bar_sync", 3)


def run(nb: int, S: int, consumers: int, halves: bool, pingpong: bool, kv_ahead: bool, seed: int,
        overlap: bool = False) -> int:
    """One random interleaving of one CTA; returns the steps taken. Raises AssertionError on a hang or a hazard."""
    rng = random.Random(seed)
    empty = 4 if halves else 4 * consumers
    bars = {"q": MBarrier(128)}
    for s in range(S):
        for v in "kv":
            bars[f"full_{v}{s}"] = MBarrier(128)
            bars[f"empty_{v}{s}"] = MBarrier(empty)
    named = {i: Named() for i in (1, 2, 3)}
    agents = {"p": producer(nb, S, kv_ahead, halves)}
    for w in range(consumers):
        agents[f"c{w}"] = consumer(w, nb, S, halves, pingpong, overlap)
    pending = {name: next(gen, None) for name, gen in agents.items()}
    blocked = set()  # warpgroups in a bar.sync whose generation has not completed
    landing = []  # cp.async arrivals in flight: (barrier, n)
    slot = {}  # (kind, stage) -> the block last written there
    steps = 0
    while any(op is not None for op in pending.values()) or landing:
        steps += 1
        assert steps < 100000, "no end"
        ready = [name for name, op in pending.items()
                 if op is not None and name not in blocked and not (op[0] == "wait" and not bars[op[1]].passed(op[2]))]
        if landing and (not ready or rng.random() < 0.3):
            bar, n = landing.pop(rng.randrange(len(landing)))
            bars[bar].arrive(n)
            continue
        assert ready, f"hang: every warpgroup waits ({pending}, blocked {sorted(blocked)})"
        name = rng.choice(ready)
        op = pending[name]
        kind = op[0]
        if kind == "cp_arrive":
            landing.append((op[1], op[2]))
        elif kind == "arrive":
            bars[op[1]].arrive(op[2])
        elif kind == "fill":
            v, s, b = op[1]
            slot[v, s] = b
        elif kind == "read":
            v, s, b = op[1]
            assert slot.get((v, s)) == b, f"{name} reads block {b}'s {v} but stage {s} holds {slot.get((v, s))}"
        elif kind in ("bar_sync", "bar_arrive"):
            bar = named[op[1]]
            bar.threads += 128
            if kind == "bar_sync":
                bar.waiting.add(name)
                blocked.add(name)
            if bar.threads == 256:
                assert bar.waiting, f"named barrier {op[1]}: a generation completed with no warpgroup waiting on it"
                for other in bar.waiting:
                    blocked.discard(other)
                    if other != name:
                        pending[other] = next(agents[other], None)
                bar.threads, bar.waiting, bar.generation = 0, set(), bar.generation + 1
            elif kind == "bar_sync":
                continue  # blocked until the generation completes (the op advances then)
        pending[name] = next(agents[name], None)
    return steps
