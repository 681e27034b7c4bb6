"""Whether the API server answers one kind of request, and what waits for its next answer.

The effect runner keeps one of these for writes (a status patch, a binding) and one for reads (a
new pod's consistent read). A write that failed because the server did not answer
(``WriteDone.unanswered``) makes the rewrite timers armed from then on wait for a write's answer; a
read that failed so (``KubeUnavailable``) makes the keys parked from then on wait for a read's. When
the answer comes they go at once, not at the end of their backoff (up to 30 s); while it does not,
the oldest goes now and then as a canary. The two kinds are kept apart because a server can take
one and not the other (an admission webhook that times out stops writes, not reads): a read's
answer says nothing of the writes.

Something that went early and failed again does not go early again until it has waited out its own
delay once (``waited_out``): where the server answers some writes and not others (a webhook of one
namespace), the ones it does not answer back off at worst at half their pace, not at the pace of
the writes it answers. A canary is not held to that: canaries go one a second, whatever answers.
"""

from __future__ import annotations

from collections.abc import Callable

Ident = tuple[str, str]  # (key, an id of the thing waiting: a timer's id, or the key again)


class Silence:
    def __init__(self) -> None:
        self.silent = False
        self._waiting: dict[Ident, str] = {}  # what waits for the next answer, oldest first -> its kind
        self._early: set[tuple[str, str]] = set()  # (key, kind) went early, its delay not waited out since
        # silences ended so far, and the one each key's last unanswered request fell in: a request
        # that failed in a silence and is put off only after it ended goes at once (``wait``)
        self._ended = 0
        self._failed_in: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def failed(self, key: str) -> None:
        """A request of this kind, for ``key``, was not answered."""
        self.silent = True
        self._failed_in[key] = self._ended

    def answered(self) -> bool:
        """A request of this kind was answered; True when that ends a silence (``release`` then)."""
        was, self.silent = self.silent, False
        if was:
            self._ended += 1
            # a failure older than the silence before this one was decided long since: forgotten
            # (a key deleted while its writes failed is never answered, and must not be kept)
            self._failed_in = {k: n for k, n in self._failed_in.items() if n >= self._ended - 1}
        return was

    def wait(self, key: str, ident: str, kind: str) -> bool:
        """``ident`` of ``key`` (of ``kind``: a rewrite's purpose, a parked key) was put off after a
        failure: while the server is silent, it waits for its answer — unless it already went
        early once since its own delay last ran out. True: go now instead (marked as gone early),
        its failure fell in a silence that has ended since (an answer came while it was decided)."""
        if (key, kind) in self._early:
            return False
        if self.silent:
            self._waiting[(key, ident)] = kind
            return False
        if self._failed_in.get(key, self._ended) < self._ended:
            self._early.add((key, kind))
            return True
        return False

    def drop(self, key: str, ident: str) -> None:
        """It went another way (its own delay ran out, its key was halted or handed over)."""
        self._waiting.pop((key, ident), None)

    def drop_keys(self, which: Callable[[str], bool]) -> None:
        for key, ident in [w for w in self._waiting if which(w[0])]:
            del self._waiting[(key, ident)]
        self._early = {e for e in self._early if not which(e[0])}
        self._failed_in = {k: n for k, n in self._failed_in.items() if not which(k)}

    def waited_out(self, key: str, kind: str) -> None:
        """Its own delay ran out: it may go early again."""
        self._early.discard((key, kind))

    def done(self, key: str, kind: str) -> None:
        """A request of ``key`` was answered: nothing of it waits, it may go early again."""
        self._early.discard((key, kind))
        self._failed_in.pop(key, None)

    def release(self) -> list[Ident]:
        """Everything waiting, oldest first, to go now (each marked as gone early)."""
        out = list(self._waiting.items())
        self._waiting.clear()
        self._early.update((key, kind) for (key, _), kind in out)
        return [ident for ident, _ in out]

    def canary(self) -> Ident | None:
        """The oldest thing waiting, to go now, or None. Not marked as gone early: canaries go one at
        a time at their own pace, whatever other keys' answers do; one that fails waits at the back."""
        if not self._waiting:
            return None
        ident = next(iter(self._waiting))
        del self._waiting[ident]
        return ident

    def clear(self) -> None:
        self._waiting.clear()
        self._early.clear()
        self._failed_in.clear()
