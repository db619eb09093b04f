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
        self._complete()

    def _complete(self) -> None:  # the phase completes once every arrival is in
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


def simulate(agents: dict, bars: dict, seed: int, limit: int, paired: bool = False) -> int:
    """One random interleaving of warpgroups `agents` (generators of barrier operations, keyed (CTA, name)) over
    mbarriers `bars` (keyed (CTA, name)): a scheduler that runs whichever warpgroup can go on, lands cp.async arrivals
    and bulk copies at random later steps, answers "test" ops (gen.send) with whether that phase completed, and holds
    the warpgroups of a named barrier or the cluster barrier until all have arrived. `paired`: a read needs its block
    in the partner's half of the stage too. Returns the steps taken; raises AssertionError on a hang or a hazard."""
    rng = random.Random(seed)
    named = {}  # (CTA, named barrier id) -> Named
    pending = {key: next(gen, None) for key, gen in agents.items()}
    blocked, in_cluster = set(), set()  # in a bar.sync whose generation has not completed; at the cluster barrier
    landing = []  # ("cp", CTA, barrier, n) and ("bulk", source CTA, (v, s, b)) in flight
    own, peer = {}, {}  # (CTA, v, s) -> the block this CTA wrote into the stage / its partner forwarded there
    steps = 0

    def advance(key, value=None):
        try:
            pending[key] = agents[key].send(value)
        except StopIteration:
            pending[key] = None

    def waits(key, op):
        return op[0] == "wait" and not bars[key[0], op[1]].passed(op[2])

    while any(op is not None for op in pending.values()) or landing:
        steps += 1
        assert steps < limit, "no end"
        ready = [key for key, op in pending.items()
                 if op is not None and key not in blocked and key not in in_cluster and not waits(key, op)]
        if landing and (not ready or rng.random() < 0.3):
            item = landing.pop(rng.randrange(len(landing)))
            if item[0] == "cp":
                bars[item[1], item[2]].arrive(item[3])
            else:
                src, (v, s, b) = item[1], item[2]
                assert own.get((src, v, s)) == b, f"CTA {src}'s forward of block {b}'s {v} read a refilled stage {s}"
                peer[1 - src, v, s] = b
                bars[1 - src, f"full_{v}{s}"].add_tx(-1)
            continue
        assert ready, f"hang: every warpgroup waits ({pending}, blocked {sorted(blocked)}, in the cluster barrier " \
                      f"{sorted(in_cluster)})"
        key = rng.choice(ready)
        r, op = key[0], pending[key]
        kind = op[0]
        if kind == "cp_arrive":
            landing.append(("cp", r, op[1], op[2]))
        elif kind == "test":
            advance(key, bars[r, op[1]].passed(op[2]))
            continue
        elif kind == "bulk":
            landing.append(("bulk", r, op[1]))
        elif kind == "arrive_tx":
            bars[r, op[1]].add_tx(1)
            bars[r, op[1]].arrive(op[2])
        elif kind == "arrive":  # this CTA's barrier only
            bars[r, op[1]].arrive(op[2])
        elif kind == "release":  # this CTA's barrier and the partner's
            bars[r, op[1]].arrive(op[2])
            bars[1 - r, op[1]].arrive(op[2])
        elif kind == "fill":
            v, s, b = op[1]
            own[r, v, s] = b
        elif kind == "read":
            v, s, b = op[1]
            held = (own.get((r, v, s)), peer.get((r, v, s)) if paired else b)
            assert held == (b, b), f"{key} reads block {b}'s {v} but stage {s} holds {held}"
        elif kind == "cluster":
            in_cluster.add(key)
            if len(in_cluster) == len(agents):
                for other in list(in_cluster):
                    advance(other)
                in_cluster.clear()
            continue
        elif kind in ("bar_sync", "bar_arrive"):
            bar = named.setdefault((r, op[1]), Named())
            bar.threads += 128
            if kind == "bar_sync":
                bar.waiting.add(key)
                blocked.add(key)
            if bar.threads == 256:
                assert bar.waiting, f"named barrier {op[1]}: a generation completed with no warpgroup waiting on it"
                for other in bar.waiting:
                    blocked.discard(other)
                    advance(other)
                bar.threads, bar.waiting, bar.generation = 0, set(), bar.generation + 1
            if kind == "bar_sync":
                continue  # advanced when the generation completes
        advance(key)
    return steps


def run(nb: int, S: int, consumers: int, halves: bool, pingpong: bool, kv_ahead: bool, seed: int,
        overlap: bool = False) -> int:
    """One random interleaving of one CTA (`simulate`); returns the steps taken."""
    empty = 4 if halves else 4 * consumers
    bars = {(0, "q"): MBarrier(128)}
    for s in range(S):
        for v in "kv":
            bars[0, f"full_{v}{s}"] = MBarrier(128)
            bars[0, f"empty_{v}{s}"] = MBarrier(empty)
    agents = {(0, "p"): producer(nb, S, kv_ahead, halves)}
    for w in range(consumers):
        agents[0, f"c{w}"] = consumer(w, nb, S, halves, pingpong, overlap)
    return simulate(agents, bars, seed, 100000)


# ---------------------------------------------------------------------------------------------- cluster pairs


@dataclass
class TxBarrier(MBarrier):
    """An mbarrier with a transaction count (PTX: expect_tx adds bytes, complete_tx removes them, and the phase
    completes when no arrival and no byte is pending; the count may go below zero, as when a copy lands before its
    bytes are expected)."""

    tx: int = 0

    def add_tx(self, n: int) -> None:
        self.tx += n
        self._complete()

    def _complete(self) -> None:
        if self.left == 0 and self.tx == 0:
            self.phases += 1
            self.left = self.count


def pair_producer(nb, S, halves):
    """A paired CTA's producer (tree_attn_ws.cu, TA_CLUSTER): its half of each block, and thread 0's forwards. A
    "test" op is answered (gen.send) with whether the barrier's phase of that parity completed."""
    issued, fwd = {"k": 0, "v": 0}, {"k": 0, "v": 0}
    yield ("cp_arrive", "q", 128)

    def forward(v):
        b = fwd[v]
        s, _ = stage_of(b, S, halves)
        fwd[v] += 1
        yield ("bulk", (v, s, b))  # lands later in the partner's stage, completing on its full barrier
        yield ("arrive_tx", f"full_{v}{s}", 1)  # this CTA's half is in; the partner's bytes are owed

    def landed_parity(v):
        s, u = stage_of(fwd[v], S, halves)
        return f"half_{v}{s}", u & 1

    def forward_landed():  # every half that has landed, in block order, without waiting
        for w in "kv":
            while fwd[w] < issued[w] and (yield ("test", *landed_parity(w))):
                yield from forward(w)

    def forward_all():  # after the last load: every half issued, waiting for each to land
        for v in "kv":
            while fwd[v] < issued[v]:
                yield ("wait", *landed_parity(v))
                yield from forward(v)

    def load(b, v):
        s, u = stage_of(b, S, halves)
        if u > 0:
            # until the stage is released (by both CTAs' consumers, the partner's waiting on these forwards)
            while not (yield ("test", f"empty_{v}{s}", (u + 1) & 1)):
                yield from forward_landed()
            yield ("wait", f"empty_{v}{s}", (u + 1) & 1)
        yield ("fill", (v, s, b))
        yield ("cp_arrive", f"half_{v}{s}", 128)
        issued[v] += 1
        yield from forward_landed()

    for b in range(nb):
        yield from load(b, "k")
        yield from load(b, "v")
    yield from forward_all()
    yield ("cluster",)


def pair_consumer(w, nb, S, halves):
    """A paired CTA's consumer: reads need both halves of the block, releases arrive on both CTAs' empty barriers."""
    b0, step = (w, 2) if halves else (0, 1)
    yield ("wait", "q", 0)
    for b in range(b0, nb, step):
        for v in "kv":
            s, u = stage_of(b, S, halves)
            yield ("wait", f"full_{v}{s}", u & 1)
            yield ("read", (v, s, b))
            yield ("release", f"empty_{v}{s}", 4)  # on this CTA's barrier and on the partner's
    yield ("cluster",)
    if halves:
        yield ("bar_sync", 3)
        yield ("bar_sync", 3)


def run_pair(nb: int, S: int, second_halves: bool, seed: int) -> int:
    """One random interleaving of a cluster pair (`simulate`): CTA 0 a full group (two consumers on two tiles), CTA 1
    the request's second group (halves or not). Checks that it ends, that every read sees its block in both halves of
    the stage, and that a forward's source still holds its block when the copy lands. Returns the steps taken."""
    halves = (False, second_halves)
    releases = sum(4 if h else 8 for h in halves)
    bars, agents = {}, {}
    for r in (0, 1):
        bars[r, "q"] = MBarrier(128)
        for s in range(S):
            for v in "kv":
                bars[r, f"full_{v}{s}"] = TxBarrier(1)
                bars[r, f"empty_{v}{s}"] = MBarrier(releases)
                bars[r, f"half_{v}{s}"] = MBarrier(128)
        agents[r, "p"] = pair_producer(nb, S, halves[r])
        for w in range(2):
            agents[r, f"c{w}"] = pair_consumer(w, nb, S, halves[r])
    return simulate(agents, bars, seed, 200000, paired=True)
