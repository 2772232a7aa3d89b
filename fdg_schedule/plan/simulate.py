"""An event-by-event simulator of per-rank action streams: when each action starts and ends, and what each rank holds.

Every rank runs its stream in order. An action starts when its rank is free and, for a receive,
when the message is there; among all ranks the action that can start earliest runs next, so shared
links see messages in the order they were posted. What an action costs comes from
:class:`ChunkCosts` (one per chunk, i.e. virtual stage); the ranks of a data-parallel group are
taken to move in lockstep, so one pipeline replica is simulated and the all-reduce is a duration.

Note [what a send costs the sender]: a non-blocking send (FDG's batched ``isend``, Megatron's
``batch_isend_irecv``) costs the sender nothing; the message holds the sender's link for its
occupancy (queued behind earlier messages on that link) and arrives ``latency`` later. A blocking
send (DeepSpeed's ``p2p.send``) is a rendezvous: the transfer starts once the receiver has posted
the receive and the link is free, and both ranks are busy until it has arrived.

Note [shared host]: when ``shared_host`` is set, every compute action also needs the one host
thread for ``host_s`` seconds (the FDG authors' code drives all GPUs from one Python process whose
threads take turns): its device part starts with its host part and it ends after both.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

from fdg_schedule.plan.streams import COMPUTE, Action, Op, Stream


@dataclasses.dataclass(frozen=True)
class Link:
    """One message: how long it holds ``channel``, when it arrives after leaving it, and its size."""

    occupancy_s: float
    latency_s: float
    nbytes: float
    inter_node: bool
    channel: str


@dataclasses.dataclass(frozen=True)
class ChunkCosts:
    """What one chunk (virtual stage) costs per micro-batch, and the links to its neighbours."""

    forward_s: float
    backward_s: float
    step_s: float = 0.0
    allreduce_s: float = 0.0
    backward_input_s: float = 0.0  # ZB's I; the weight part is backward_s - backward_input_s
    held_bytes: float = 0.0  # kept from the forward until the backward (or I and W) frees it
    weight_grad_bytes: float = 0.0  # of held_bytes, what a split backward keeps from I until W
    backward_extra_bytes: float = 0.0  # held only while the backward runs (a recomputed forward)
    static_bytes: float = 0.0  # weights, gradients, optimizer state: always there
    to_next: Link | None = None  # the activation to chunk + 1
    to_prev: Link | None = None  # the input gradient to chunk - 1
    host_s: float = 0.0  # per compute action, see Note [shared host]

    def duration(self, op: Op) -> float:
        if op is Op.FORWARD:
            return self.forward_s
        if op is Op.BACKWARD:
            return self.backward_s
        if op is Op.BACKWARD_INPUT:
            return self.backward_input_s
        if op is Op.BACKWARD_WEIGHT:
            return self.backward_s - self.backward_input_s
        if op is Op.STEP:
            return self.step_s
        if op is Op.ALLREDUCE:
            return self.allreduce_s
        return 0.0


@dataclasses.dataclass(frozen=True)
class Event:
    rank: int
    action: Action
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class Message:
    src: int
    dst: int
    action: Action  # the send
    posted: float
    departed: float  # left the sender's link
    arrived: float
    link: Link


@dataclasses.dataclass
class Timeline:
    """The simulated run: every action's start and end, every message, and memory per rank."""

    events: list[Event]
    messages: list[Message]
    peak_bytes: list[float]  # held activations and stashes, peak, per rank (static bytes not included)
    static_bytes: list[float]
    ranks: int

    @property
    def makespan(self) -> float:
        return max((e.end for e in self.events), default=0.0)

    def busy(self, rank: int, start: float = 0.0, end: float = float("inf")) -> float:
        """Seconds ``rank`` computed (F, B, I, W, S) inside ``[start, end)``."""
        total = 0.0
        for e in self.events:
            if e.rank == rank and e.action.op in COMPUTE:
                total += max(0.0, min(e.end, end) - max(e.start, start))
        return total

    def grid(self, slot_s: float, ops: frozenset[Op] = COMPUTE) -> list[str]:
        """Each rank's compute as a row of ``slot_s``-wide cells (``.`` idle), for golden tests and docs.

        An action of ``n`` slots fills ``n`` cells with its compact text; a cell holds at most one action.
        """
        width = max(len(e.action.short()) for e in self.events if e.action.op in ops)
        slots = round(self.makespan / slot_s)
        rows = []
        for r in range(self.ranks):
            cells = ["."] * slots
            for e in self.events:
                if e.rank == r and e.action.op in ops and e.end > e.start:
                    for i in range(round(e.start / slot_s), round(e.end / slot_s)):
                        cells[i] = e.action.short()
            while cells and cells[-1] == ".":  # idle after its last action: nothing to draw
                cells.pop()
            rows.append(" ".join(c.ljust(width) for c in cells).rstrip())
        return rows

    def ends(self, rank: int, op: Op) -> list[float]:
        """End times of ``op`` on ``rank``, in order."""
        return [e.end for e in self.events if e.rank == rank and e.action.op is op]


class Deadlock(RuntimeError):
    pass


def simulate(
    streams: Sequence[Stream],
    chunks: Sequence[ChunkCosts],
    pipe_collective_s: float = 0.0,
    shared_host: bool = False,
) -> Timeline:
    """Run ``streams`` (one per rank) with ``chunks[c]`` the costs of chunk ``c`` (on rank ``c % ranks``)."""
    return _Simulation(streams, chunks, pipe_collective_s, shared_host).run()


class _Simulation:
    def __init__(
        self, streams: Sequence[Stream], chunks: Sequence[ChunkCosts], pipe_collective_s: float, shared_host: bool
    ) -> None:
        self.streams, self.chunks = streams, chunks
        self.ranks = len(streams)
        if len(chunks) % self.ranks:
            raise ValueError(f"{len(chunks)} chunks cannot sit evenly on {self.ranks} ranks")
        self.pipe_collective_s, self.shared_host = pipe_collective_s, shared_host
        self.pc = [0] * self.ranks
        self.clock = [0.0] * self.ranks
        self.held = [0.0] * self.ranks
        self.peak = [0.0] * self.ranks
        self.channel_free: dict[str, float] = {}
        self.host_free = 0.0
        self.arrivals: dict[tuple[str, int | None, int], float] = {}  # (kind, micro-batch, to chunk) -> time
        self.offers: dict[tuple[str, int | None, int], tuple[float, int, Action]] = {}  # rendezvous sends
        self.offering: set[int] = set()  # ranks blocked in a rendezvous send
        self.collective: dict[int, float] = {}  # rank -> arrival at the pending pipeline collective
        self.events: list[Event] = []
        self.messages: list[Message] = []
        self.version = [0] * self.ranks
        self.heap: list[tuple[float, int, int]] = []

    # -- the loop ---------------------------------------------------------------------------------

    def run(self) -> Timeline:
        for r in range(self.ranks):
            self._schedule(r)
        while self.heap:
            t, version, r = heapq.heappop(self.heap)
            if version != self.version[r]:
                continue
            now = self._start_time(r)
            if now is None:
                continue
            if now > t + 1e-15:  # a shared link got busier since this entry was pushed
                heapq.heappush(self.heap, (now, version, r))
                continue
            self._execute(r, now)
        stuck = [r for r in range(self.ranks) if self.pc[r] < len(self.streams[r]) or r in self.offering]
        if stuck:
            raise Deadlock(self._grid(stuck))
        static = [sum(self.chunks[c].static_bytes for c in range(r, len(self.chunks), self.ranks))
                  for r in range(self.ranks)]  # fmt: skip
        return Timeline(self.events, self.messages, self.peak, static, self.ranks)

    def _schedule(self, r: int) -> None:
        self.version[r] += 1
        t = self._start_time(r)
        if t is not None:
            heapq.heappush(self.heap, (t, self.version[r], r))

    def _next(self, r: int) -> Action | None:
        stream = self.streams[r]
        return stream[self.pc[r]] if self.pc[r] < len(stream) else None

    # -- when can a rank's next action start ------------------------------------------------------

    def _start_time(self, r: int) -> float | None:
        action = self._next(r)
        if action is None or r in self.offering or r in self.collective:
            return None
        op = action.op
        if op in (Op.RECV_ACTIVATION, Op.RECV_GRAD):
            key = self._recv_key(action)
            if key in self.arrivals:
                return max(self.clock[r], self.arrivals[key])
            if key in self.offers:
                posted, _, send = self.offers[key]
                link = self._link(send)
                return max(self.clock[r], posted, self.channel_free.get(link.channel, 0.0))
            return None
        if self.shared_host and op in COMPUTE and self.chunks[action.stage].host_s > 0:
            return max(self.clock[r], self.host_free)
        return self.clock[r]

    # -- running an action -----------------------------------------------------------------------

    def _execute(self, r: int, start: float) -> None:
        action = self._next(r)
        assert action is not None
        op = action.op
        self.pc[r] += 1
        if op in (Op.SEND_ACTIVATION, Op.SEND_GRAD):
            self._send(r, action, start)
        elif op in (Op.RECV_ACTIVATION, Op.RECV_GRAD):
            self._receive(r, action, start)
        elif op is Op.PIPE_COLLECTIVE:
            self._arrive_at_collective(r, start)
            return
        else:
            self._compute(r, action, start)
        self._schedule(r)

    def _compute(self, r: int, action: Action, start: float) -> None:
        costs = self.chunks[action.stage]
        duration = costs.duration(action.op)
        if action.op in COMPUTE and costs.host_s > 0:
            if self.shared_host:
                self.host_free = start + costs.host_s
            duration = max(duration, costs.host_s)
        end = start + duration
        self._account_memory(r, action, costs)
        self.clock[r] = end
        self.events.append(Event(r, action, start, end))

    def _account_memory(self, r: int, action: Action, costs: ChunkCosts) -> None:
        op = action.op
        if op is Op.FORWARD:
            self.held[r] += costs.held_bytes
            self.peak[r] = max(self.peak[r], self.held[r])
        elif op is Op.BACKWARD:
            self.peak[r] = max(self.peak[r], self.held[r] + costs.backward_extra_bytes)
            self.held[r] -= costs.held_bytes
        elif op is Op.BACKWARD_INPUT:
            self.peak[r] = max(self.peak[r], self.held[r] + costs.backward_extra_bytes)
            self.held[r] -= costs.held_bytes - costs.weight_grad_bytes
        elif op is Op.BACKWARD_WEIGHT:
            self.held[r] -= costs.weight_grad_bytes

    def _send(self, r: int, action: Action, start: float) -> None:
        key = self._send_key(action)
        if action.blocking:
            self.offers[key] = (start, r, action)
            self.offering.add(r)
            self.clock[r] = start
            dst = self._rank_of(key[2])
            self._schedule(dst)
            return
        link = self._link(action)
        departed = max(start, self.channel_free.get(link.channel, 0.0)) + link.occupancy_s
        self.channel_free[link.channel] = departed
        arrived = departed + link.latency_s
        self.arrivals[key] = arrived
        dst = self._rank_of(key[2])
        self.messages.append(Message(r, dst, action, start, departed, arrived, link))
        self.clock[r] = start
        self._schedule(dst)

    def _receive(self, r: int, action: Action, start: float) -> None:
        key = self._recv_key(action)
        if key in self.offers:  # rendezvous: the transfer runs now, both ranks busy until it arrives
            posted, src, send = self.offers.pop(key)
            link = self._link(send)
            departed = start + link.occupancy_s
            self.channel_free[link.channel] = departed
            arrived = departed + link.latency_s
            self.messages.append(Message(src, r, send, posted, departed, arrived, link))
            self.events.append(Event(src, send, posted, arrived))
            self.clock[src] = arrived
            self.offering.discard(src)
            self._schedule(src)
        else:
            arrived = self.arrivals.pop(key)
        end = max(start, arrived)
        self.events.append(Event(r, action, self.clock[r], end))
        self.clock[r] = end

    def _arrive_at_collective(self, r: int, start: float) -> None:
        self.collective[r] = start
        self.clock[r] = start
        if len(self.collective) < self.ranks:
            self.version[r] += 1  # parked until the last rank arrives
            return
        end = max(self.collective.values()) + self.pipe_collective_s
        for q, arrived in self.collective.items():
            self.events.append(Event(q, Action(q, Op.PIPE_COLLECTIVE), arrived, end))
            self.clock[q] = end
        self.collective.clear()
        for q in range(self.ranks):
            self._schedule(q)

    # -- helpers --------------------------------------------------------------------------------

    def _rank_of(self, chunk: int) -> int:
        return chunk % self.ranks

    def _send_key(self, action: Action) -> tuple[str, int | None, int]:
        if action.op is Op.SEND_ACTIVATION:
            return ("activation", action.micro_batch, action.stage + 1)
        return ("grad", action.micro_batch, action.stage - 1)

    def _recv_key(self, action: Action) -> tuple[str, int | None, int]:
        kind = "activation" if action.op is Op.RECV_ACTIVATION else "grad"
        return (kind, action.micro_batch, action.stage)

    def _link(self, send: Action) -> Link:
        costs = self.chunks[send.stage]
        link = costs.to_next if send.op is Op.SEND_ACTIVATION else costs.to_prev
        if link is None:
            raise ValueError(f"chunk {send.stage} has no link for {send}: a first chunk sends no gradient and a "
                             "last chunk no activation")  # fmt: skip
        return link

    def _grid(self, stuck: list[int]) -> str:
        lines = ["the streams deadlock; each rank's next actions (>> marks where it is stuck):"]
        for r in range(self.ranks):
            # a rank blocked in a rendezvous send is stuck at that send
            stream, pc = self.streams[r], self.pc[r] - (r in self.offering)
            done = " ".join(a.short() for a in stream[max(0, pc - 4) : pc])
            todo = " ".join(a.short() for a in stream[pc : pc + 4])
            mark = ">>" if r in stuck else "  "
            lines.append(f"  rank {r:2d} {mark} ... {done} | {todo}")
        return "\n".join(lines)
