"""Fault-tolerant replica groups (diloco.fault_tolerant): a quorum at every synchronisation.

The rules (docs/diloco.md states them for users):

1. Every exchange is a *round* (a counter every group keeps alike). Its members are fixed by
   the first rank of any group to arrive at it (a compare-and-set in the launcher's store): the
   members of the last committed round whose group is still in the same life (not dead, not
   restarted since), plus the *joiners*: restarted groups all of whose ranks are ready.
2. Each member's ranks mark their arrival; the exchange starts once every rank of every member
   has arrived. A member whose group the launcher marks dead before that, or that fails during
   the exchange, makes this an aborted attempt; the round is tried again (a new attempt, its
   members fixed the same way, so without the dead group) from the same pseudo-gradients.
3. An attempt commits when every rank of every member has completed its exchange; the first
   rank to see that (or a failure) decides for all (compare-and-set), so no rank applies a sum
   another rank discards.
4. Joiners send zeros and the sum is divided by the number of members that are not joiners: the
   average is over the live groups. After the outer step, the first live member sends each
   joiner its whole state (the inner model and optimizer state, the anchor and outer momentum,
   the step, the schedule and the data position); the joiner continues from there, a member
   like the others from the next round on. Joiners are not admitted at the run's last step.
5. A rank waits at most diloco.quorum_timeout_s for the members of an attempt to arrive; then it
   fails (a hang is an error, never silent).

Each round's view is a line in the rank's log when it differs from the last one's (which group
dropped out, which rejoined), and the step's record says how many groups it averaged.
"""

from __future__ import annotations

import datetime
import json
import os
import time

import torch

from plait import comm
from plait.errors import CommError
from plait.train.diloco_replicas import (
    AXIS,
    ENV_GENERATION,
    gloo_group,
    launcher_store,
    on_the_wire,
)

POLL_S = 0.005


class QuorumTimeout(CommError):
    """The members of a DiLoCo round did not all arrive within diloco.quorum_timeout_s."""


def state_checksum(tensors) -> float:
    """A float64 sum of every element and of every square: equal on both sides of an exact copy."""
    total = 0.0
    for t in tensors:
        d = t.detach().double()
        total += float(d.sum()) + float((d * d).sum())
    return total


class _Done:
    """A completed exchange, as the engine's handles look."""

    def __init__(self, result: torch.Tensor):
        self.result = result

    def wait(self) -> torch.Tensor:
        return self.result


class QuorumReplicas:
    """The replica axis over the groups alive at each round (the module docstring's rules)."""

    def __init__(self, mesh, group: int, groups: int, timeout_s: float, last_step: int):
        self.mesh, self.group, self.groups = mesh, group, groups
        self.last_step = last_step  # no joiner is admitted at the run's last step
        self.attempt = 0
        self.timeout_s = timeout_s
        self.position, self.positions = mesh.global_rank, mesh.world_size
        self.generation = int(os.environ.get(ENV_GENERATION, "0"))
        self.store = launcher_store(max(timeout_s, 60.0))
        self.round = 0
        self.view: dict | None = None  # the last committed round's
        self.joiners_now: list[int] = []  # joiners of this step's rounds (healed at its end)
        self.step = 0
        self._pg = None  # (members, process group) of the last committed attempt, reused
        self.rejoining = self.generation > 0
        self.log: list[str] = []

    # --- the store -----------------------------------------------------------------------------

    def _state(self, g: int) -> tuple[str, int]:
        raw = self.store.get(f"state/{g}").decode() if self.store.check([f"state/{g}"]) else "dead:-1"
        kind, gen = raw.split(":")
        return kind, int(gen)

    def _in_life(self, g: int, gen: int) -> bool:
        kind, now = self._state(g)
        return kind != "dead" and now == gen

    def _ready(self, g: int, gen: int) -> bool:
        return self.store.add(f"ready/{g}/{gen}", 0) == self.positions

    def _fix_view(self, r: int, a: int, step: int, fragment: int, size: int) -> dict:
        """The view of round r, attempt a: fixed by its first arriver, read by every other."""
        key = f"view/{r}/{a}"
        if self.store.check([key]):
            return json.loads(self.store.get(key))
        if a > 0:
            base = json.loads(self.store.get(f"view/{r}/{a - 1}"))["members"]
        elif r > 0:
            base = json.loads(self.store.get(f"view/{r - 1}/{int(self.store.get(f'commit/{r - 1}'))}"))[
                "members"
            ]
        else:
            base = {str(g): 0 for g in range(self.groups)}
        members = {g: gen for g, gen in base.items() if self._in_life(int(g), gen)}
        live = sorted(int(g) for g in members)
        joiners = []
        if step != self.last_step:
            for g in range(self.groups):
                kind, gen = self._state(g)
                if str(g) not in members and kind == "starting" and self._ready(g, gen):
                    members[str(g)] = gen
                    joiners.append(g)
        proposal = {
            "members": members,
            "live": live,
            "joiners": joiners,
            "step": step,
            "fragment": fragment,
            "size": size,
        }
        return json.loads(self.store.compare_set(key, "", json.dumps(proposal)))

    def _wait_all(self, prefix: str, view: dict, what: str) -> bool:
        """Whether every rank of every member wrote `prefix/<g>/<pos>` before any member died."""
        keys = [f"{prefix}/{g}/{p}" for g in view["members"] for p in range(self.positions)]
        deadline = time.monotonic() + self.timeout_s
        while not self.store.check(keys):
            if any(not self._in_life(int(g), gen) for g, gen in view["members"].items()):
                return False
            if time.monotonic() > deadline:
                missing = sorted({k.split("/")[-2] for k in keys if not self.store.check([k])})
                raise QuorumTimeout(
                    f"DiLoCo round {prefix}: replica groups {', '.join(missing)} did not {what} within "
                    f"diloco.quorum_timeout_s = {self.timeout_s}s (alive, but stuck)"
                )
            time.sleep(POLL_S)
        return True

    # --- one round -----------------------------------------------------------------------------

    def all_reduce(self, delta: torch.Tensor, wire_dtype: torch.dtype, step: int, fragment: int):
        """Round `self.round`: the sum of the members' `delta` (zeros from joiners); returns
        (the completed exchange, the number of live groups averaged)."""
        view, summed = self._round(delta, wire_dtype, step, fragment)
        return _Done(summed), len(view["live"])

    def _round(self, delta, wire_dtype, step: int, fragment: int, joining: bool = False):
        r = self.round
        a = 0
        while True:
            view = self._fix_view(r, a, step, fragment, delta.numel())
            if str(self.group) not in view["members"]:
                if joining:
                    return None, None  # not admitted to this round: the joiner waits for the next
                raise CommError(f"DiLoCo round {r}: group {self.group} is alive but not in the quorum {view}")
            tag, self.attempt = f"{r}/{a}", a
            ok = False
            summed = None
            self.store.set(f"arrive/{tag}/{self.group}/{self.position}", "1")
            if self._wait_all(f"arrive/{tag}", view, "arrive"):
                try:
                    summed = self._exchange(view, delta, wire_dtype, joining)
                    ok = True
                except Exception:  # a member died during the exchange: the attempt aborts
                    self._pg = None
            self.store.set(f"done/{tag}/{self.group}/{self.position}", "ok" if ok else "fail")
            decision = self._decide(tag, view)
            if decision == "commit":
                self.store.compare_set(f"commit/{r}", "", str(a))
                self.store.set("rounds", str(r + 1))  # (every committer writes the same)
                self._committed(view, r)
                return view, summed
            self._pg = None
            a += 1

    def _exchange(self, view: dict, delta, wire_dtype, joining: bool):
        members = sorted(int(g) for g in view["members"])
        index, size = members.index(self.group), len(members)
        life = sorted(view["members"].items())  # a group restarted since is another member
        if self._pg is None or self._pg[0] != life:
            prefix = f"diloco/pg/{self.round}/{self.attempt}/pos{self.position}/"
            self._pg = (life, gloo_group(self.store, prefix, index, size, self.timeout_s))
        self.mesh.attach_axis(AXIS, self._pg[1], index, size)
        wire = torch.zeros(delta.numel(), dtype=wire_dtype) if joining else on_the_wire(delta, wire_dtype)
        comm.all_reduce(wire, self.mesh, AXIS, logical_bytes=delta.numel() * 4)
        return wire.to(delta.device, torch.float32)

    def _decide(self, tag: str, view: dict) -> str:
        complete = self._wait_all(f"done/{tag}", view, "complete the exchange")
        if complete:
            keys = [f"done/{tag}/{g}/{p}" for g in view["members"] for p in range(self.positions)]
            complete = all(v == b"ok" for v in self.store.multi_get(keys))
        return self.store.compare_set(f"decide/{tag}", "", "commit" if complete else "retry").decode()

    def _committed(self, view: dict, r: int) -> None:
        previous = self.view
        self.view = view
        self.round = r + 1
        self.joiners_now += view["joiners"]
        if previous is None or sorted(previous["live"]) != sorted(view["live"]) or view["joiners"]:
            dropped = sorted(set(previous["live"] if previous else range(self.groups)) - set(view["live"]))
            n = len(view["live"])
            line = f"plait: diloco: step {view['step']}: round {r} averages {n} of {self.groups} groups"
            if dropped:
                line += f" (dropped: {', '.join(map(str, dropped))})"
            if view["joiners"]:
                line += f" (rejoining: {', '.join(map(str, view['joiners']))})"
            self.log.append(line)
            if self.position == 0:
                print(line, flush=True)

    # --- the engine's side ---------------------------------------------------------------------

    def outcome(self) -> dict:
        return {"groups": len(self.view["live"]) if self.view else self.groups}

    def mean_loss(self, loss: float, step: int) -> float | None:
        return None  # the loss stays the group's: a round's members can change

    def heal_joiners(self, engine, run_state: dict) -> None:
        """The first live member's ranks send this step's joiners their state (after the merge)."""
        if not self.joiners_now:
            return
        joiners, self.joiners_now = self.joiners_now, []
        if self.view is None or self.view["live"][0] != self.group:
            return
        members = sorted(int(g) for g in self.view["members"])
        if self.position == 0:
            self.store.set(f"heal/{self.round - 1}", json.dumps(run_state))
        pg = self._pg[1]
        self.store.set(
            f"heal/{self.round - 1}/sum/{self.position}", repr(state_checksum(engine.state_tensors()))
        )
        try:
            handles = []
            for tag, t in enumerate(engine.state_tensors()):
                cpu = t.detach().to("cpu").contiguous()
                for j in joiners:
                    handles.append(comm.link_isend(cpu, self.mesh, AXIS, pg, members.index(j), tag))
            for h in handles:
                h.wait()
        except Exception as exc:  # the joiner died while healing: it is started again, this group goes on
            self._pg = None
            print(f"plait: diloco: healing group(s) {joiners} failed ({exc}); going on", flush=True)

    def rejoin(self, engine) -> dict:
        """A restarted group: wait for a round that admits it, take part with zeros, then take
        the first live member's state. Returns the run state (step, scheduler, sampler)."""
        self.store.add(f"ready/{self.group}/{self.generation}", 1)
        deadline = time.monotonic() + max(self.timeout_s, 600.0)
        r = self._latest_round()
        while True:
            if all(self._state(g)[0] in ("dead", "done") for g in range(self.groups) if g != self.group):
                self._run_ended()
            a = 0
            while not self.store.check([f"view/{r}/{a}"]):
                if time.monotonic() > deadline:
                    raise QuorumTimeout(f"DiLoCo: group {self.group} was not admitted to any round")
                if all(self._state(g)[0] in ("dead", "done") for g in range(self.groups) if g != self.group):
                    self._run_ended()
                time.sleep(POLL_S * 4)
            view = json.loads(self.store.get(f"view/{r}/{a}"))
            while self.store.check([f"view/{r}/{a + 1}"]) and str(self.group) not in view["members"]:
                a += 1
                view = json.loads(self.store.get(f"view/{r}/{a}"))
            if str(self.group) in view["members"]:
                self.round = r
                delta = torch.zeros(view["size"])
                got, _ = self._round(delta, torch.float32, view["step"], view["fragment"], joining=True)
                if got is not None:
                    break
            r = max(r + 1, self._latest_round())
        # the first live member's state, then a member like the others
        self.joiners_now = []
        members = sorted(int(g) for g in self.view["members"])
        src = members.index(self.view["live"][0])
        pg = self._pg[1]
        for tag, t in enumerate(engine.state_tensors()):
            buf = torch.empty(t.shape, dtype=t.dtype)
            comm.link_irecv(buf, self.mesh, AXIS, pg, src, tag).wait()
            t.copy_(buf)
        engine.healed()
        key = f"heal/{self.round - 1}"
        check = f"{key}/sum/{self.position}"
        self.store.wait([key, check], datetime.timedelta(seconds=self.timeout_s))
        sent, got = float(self.store.get(check)), state_checksum(engine.state_tensors())
        if sent != got:
            raise CommError(f"DiLoCo: group {self.group} healed a state of checksum {got!r}, sent {sent!r}")
        self.store.set(f"state/{self.group}", f"live:{self.generation}")
        self.rejoining = False
        state = json.loads(self.store.get(key))
        if self.position == 0:
            print(
                f"plait: diloco: healed from group {self.view['live'][0]} at step {state['step']}, "
                "its state checksum equal to the sender's",
                flush=True,
            )
        return state

    def _run_ended(self) -> None:
        """No live group is left to heal from: the run ended before this group could rejoin."""
        if self.position == 0:
            print(f"plait: diloco: the run ended before group {self.group} could rejoin", flush=True)
        raise SystemExit(0)

    def _latest_round(self) -> int:
        return int(self.store.get("rounds")) if self.store.check(["rounds"]) else 0

    def close(self) -> None:
        self._pg = None
