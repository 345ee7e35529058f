"""The frame journal: result frames of invocations and the frames of topics.

Frames are rows ``(owner_id, seq, data, final)`` keyed by ``(owner_id, seq)``; the owner is an
invocation id or ``topic:<name>``. ``read_frames`` pages by seq.

``append_frame`` keeps an invocation's journal gap-free, so a follower can never skip a value: in
one transaction it reads the journal's last frame and accepts ``seq`` only when it is the next one
(and the last frame is not final). A seq already journaled answers ``duplicate`` and keeps the
first bytes (``ON CONFLICT DO NOTHING``); a gap or a frame after the final one is refused with the
seq the journal takes next, so the sender re-sends in order. With ``attempt`` / ``worker_id``, the
frame is also refused unless that attempt is the current one and that worker holds it (also after
the attempt was acked, so a late journal upload is kept); see ``invocations.lease_refusal``.
``_append_frame_in`` does the same in the caller's transaction (the group commit of sql.py), so a
frame of a batch sees the frames journaled before it in that batch.

``append_frames`` journals a batch of one invocation's frames in one transaction, in order: each
frame is either a repeat of a seq already journaled (``duplicate``) or the next seq after the
newest one (stored). A gap or a new frame after a final one refuses that frame and the rest of the
batch (the frames before it are kept, the refusal carries the expected seq); the lease checks of
``append_frame`` refuse the whole batch. New frames are inserted with one driver-level
``executemany``.

Attempts (issue 12): an invocation's journal is keyed by *position*, and the frames of an attempt
carry that attempt's own seq (0, 1, ...). The first attempt to write takes positions from 0, so
its frames are stored verbatim (position == seq). When a later attempt writes to a journal that
holds an earlier attempt's frames, the journal records a restart: a RESTART marker (a LOG frame
whose meta is ``{"restart": attempt, "attempt": attempt}``) at the next position, then the new
attempt's seq ``s`` at ``base + s`` (``base`` = the marker's position + 1, kept on the invocation
row as ``frames_base``, with ``frames_attempt``). Frames of an attempt after the first are stored
re-encoded with their position as seq and ``meta.attempt`` / ``meta.aseq`` (the attempt and its
own seq); a frame without ``meta.attempt`` is attempt 1's. Positions stay gap-free and monotonic,
so ``since`` cursors keep working across restarts; results answer the attempt's own seq (what the
sender knows), with the position in ``ChunkResult.pos``. An invocation declared resumable
(``run_config.resumable``, ``@dls.udf(resumable=True)``: a deterministic generator) is not
restarted: the new attempt continues at the earlier attempt's positions (its seqs already
journaled are duplicates, the rest follow), unless the earlier attempt's part ended with a final
frame (a retried failure's ERROR), which restarts it all the same.

Sends (two-way generators, docs/protocol.md "Two-way streams"): what a consumer sends into a paused
two-way body is journaled under ``send:<invocation id>``, one frame per yield it answers, keyed by
that yield's index in the body's attempt (``send_append``). The journal is gap-free like an
invocation's; a repeat of an index with the same bytes is a ``duplicate`` (a consumer that resumes
re-sends safely), with other bytes a 409; an index past the window (the invocation's journal
position + :data:`SEND_WINDOW`) is refused until the body got that far; nothing is taken once the
invocation ended or its sends were closed (an END frame).

Topics: ``topic_append`` takes the next seq from the ``topics`` counter (an upsert, so concurrent
posters never share a seq) and journals the frame under ``topic:<name>``, built here as plain
msgpack (the store does not import the wire codec).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from typing import Any

import msgpack
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from dreamlake.lakeshore.errors import PlaneError

from . import schema as t
from .api import OUT_OF_ORDER, UNKNOWN, ChunkResult, Frame, FrameRequest, FramesRequest
from .base import StoreBase, dialect_insert
from .engine import Database, retry_on_disconnect
from .invocations import lease_refusal
from .notify import Notifier

TOPIC_PREFIX = "topic:"
SEND_PREFIX = "send:"
SEND_WINDOW = 16  # sends may run this many yields ahead of the body's journal
FRAME_VALUE, FRAME_END = 1, 2  # wire.FRAME_VALUE / FRAME_END; the store does not import the codec
FRAME_LOG = 4  # wire.FRAME_LOG: the RESTART marker is a LOG frame (older readers skip it)


def restart_marker(position: int, attempt: int, now: float) -> bytes:
    """The encoded RESTART marker at ``position``: the frames after it come from ``attempt``."""
    note = f"attempt {attempt} restarts the stream: the frames before this one came from an earlier attempt\n"
    meta = {"restart": attempt, "attempt": attempt, "stream": "lakeshore", "ts": now}
    return bytes(msgpack.packb([FRAME_LOG, position, note.encode(), meta], use_bin_type=True))


def restamp(data: bytes, position: int, attempt: int, seq: int) -> bytes:
    """A frame of ``attempt`` re-encoded at journal ``position``, its own ``seq`` kept as
    ``meta.aseq``. Bytes that are not a frame (only a direct caller of the store sends those: the
    routes decode every frame) stay as they are where the position is the seq, else are refused."""
    try:
        kind, _seq, body, meta = msgpack.unpackb(data, raw=False)
        if meta is not None and not isinstance(meta, dict):
            raise ValueError("meta is not a map")
    except Exception as exc:
        if position == seq:
            return bytes(data)
        raise PlaneError(
            f"frame is not one encoded frame [kind, seq, body, meta]: {exc}", status=400
        ) from None
    meta = dict(meta or {})
    meta.update(attempt=attempt, aseq=seq)
    return bytes(msgpack.packb([kind, position, body, meta], use_bin_type=True))


def frame_channel(owner_id: str) -> str:
    """The notifier channel of a frame's owner: ``topic:<name>`` and ``send:<id>`` as they are,
    ``inv:<id>`` otherwise."""
    return owner_id if owner_id.startswith((TOPIC_PREFIX, SEND_PREFIX)) else f"inv:{owner_id}"


class _Statements:
    """The journal's statements, built once per dialect with bind parameters (see base.py)."""

    def __init__(self, dialect: str) -> None:
        B = sa.bindparam
        f, tp, inv = t.frames, t.topics, t.invocations
        self.lease = sa.select(
            inv.c.invocation_id,
            inv.c.state,
            inv.c.attempt,
            inv.c.worker_id,
            inv.c.frames_attempt,
            inv.c.frames_base,
        ).where(inv.c.invocation_id == B("id"))
        self.run_config = sa.select(inv.c.run_config).where(inv.c.invocation_id == B("id"))
        self.restart = (
            sa.update(inv)
            .where(inv.c.invocation_id == B("id"))
            .values(frames_attempt=B("b_attempt"), frames_base=B("b_base"))
        )
        self.last_frame = (
            sa.select(f.c.seq, f.c.final).where(f.c.owner_id == B("owner")).order_by(f.c.seq.desc()).limit(1)
        )
        self.insert_frame = (
            dialect_insert(dialect, f)
            .values(owner_id=B("owner"), seq=B("seq"), data=B("data"), final=B("final"), created_at=B("now"))
            .on_conflict_do_nothing()
            .returning(f.c.seq)
        )
        # New frames of a batch go in one executemany straight to the driver: no per-row parameter
        # processing (the values are bytes, ints, bools and floats already).
        mark = "?" if dialect == "sqlite" else "%s"
        self.insert_new_sql = (
            f"INSERT INTO {f.name} (owner_id, seq, data, final, created_at) "
            f"VALUES ({mark}, {mark}, {mark}, {mark}, {mark})"
        )
        self.read_frames = (
            sa.select(f.c.seq, f.c.data, f.c.final)
            .where(f.c.owner_id == B("owner"), f.c.seq > B("since"))
            .order_by(f.c.seq)
            .limit(B("limit", type_=sa.Integer))
        )
        self.topic_next = (
            dialect_insert(dialect, tp)
            .values(name=B("name"), next_seq=1, created_at=B("now"), namespace=B("namespace"))
            .on_conflict_do_update(index_elements=[tp.c.name], set_={"next_seq": tp.c.next_seq + 1})
            .returning(tp.c.next_seq)
        )
        self.topic_frame = sa.insert(f).values(
            owner_id=B("owner"), seq=B("seq"), data=B("data"), final=B("final"), created_at=B("now")
        )


@functools.cache
def _statements(dialect: str) -> _Statements:
    return _Statements(dialect)


class FrameStore(StoreBase):
    """The journal of invocation and topic frames."""

    def __init__(self, db: Database, notifier: Notifier) -> None:
        super().__init__(db, notifier)
        self._frame_st = _statements(db.dialect)

    @retry_on_disconnect
    def append_frame(
        self,
        owner_id: str,
        seq: int,
        data: bytes,
        final: bool,
        *,
        attempt: int | None = None,
        worker_id: str | None = None,
    ) -> ChunkResult:
        req = self._prepare_frame(FrameRequest(owner_id, seq, data, final, attempt, worker_id))
        with self.db.tx(write=True) as conn:
            result = self._append_frame_in(conn, req, time.time())
        if result.ok and not result.duplicate:
            self._notify(frame_channel(owner_id))
        return result

    @staticmethod
    def _prepare_frame(req: FrameRequest) -> FrameRequest:
        if req.seq < 0:
            raise PlaneError(f"frame seq must be >= 0, got {req.seq}", status=400)
        if req.owner_id.startswith(TOPIC_PREFIX):
            raise PlaneError("topic frames are appended by topic_append, not append_frame", status=400)
        return req

    def _append_frame_in(self, conn: Connection, req: FrameRequest, now: float) -> ChunkResult:
        """Journal a checked frame in the caller's transaction (see ``append_frame``)."""
        st = self._frame_st
        owner_id, seq = req.owner_id, req.seq
        lease = conn.execute(st.lease, {"id": owner_id}).first()
        if lease is None:
            return ChunkResult(ok=False, seq=seq, reason=f"unknown invocation {owner_id}", status=UNKNOWN)
        refused = lease_refusal(lease, req.attempt, req.worker_id)
        if refused is not None:
            return ChunkResult(ok=False, seq=seq, reason=refused[1], status=refused[0])
        attempt = req.attempt if req.attempt is not None else int(lease.attempt)
        base = self._base_in(conn, owner_id, attempt, lease, now)
        pos = base + seq
        last = conn.execute(st.last_frame, {"owner": owner_id}).first()
        expected = 0 if last is None else int(last.seq) + 1
        why = None
        if last is not None and last.final and pos > last.seq:
            why = f"the stream of {owner_id} ended with final frame {last.seq - base}"
        elif pos > expected:
            why = f"frame {seq} of {owner_id} skips ahead: the next frame is {expected - base}"
        if why is not None:
            return ChunkResult(
                ok=False,
                seq=seq,
                reason=f"{why}; send frames in order, each once",
                status=OUT_OF_ORDER,
                expected_seq=expected - base,
            )
        data = bytes(req.data) if attempt <= 1 else restamp(req.data, pos, attempt, seq)
        params = {"owner": owner_id, "seq": pos, "data": data, "final": bool(req.final), "now": now}
        if conn.execute(st.insert_frame, params).first() is None:
            return ChunkResult(ok=True, seq=seq, duplicate=True, pos=pos)
        return ChunkResult(ok=True, seq=seq, pos=pos, data=data if attempt > 1 else None)

    def _base_in(self, conn: Connection, owner_id: str, attempt: int, lease: Any, now: float) -> int:
        """The journal position of ``attempt``'s seq 0: the current base, or (for an attempt
        later than the one the journal takes) a new one, after a RESTART marker when the journal
        holds frames already. See the module docstring."""
        current = int(lease.frames_attempt or 1)
        if attempt <= current:
            return int(lease.frames_base or 0)
        st = self._frame_st
        newest = conn.execute(st.last_frame, {"owner": owner_id}).first()
        base = 0
        if newest is not None and not newest.final and self._resumable_in(conn, owner_id):
            base = int(lease.frames_base or 0)  # declared resumable: the new attempt continues
        elif newest is not None:
            marker = int(newest.seq) + 1
            params = {"owner": owner_id, "seq": marker, "data": restart_marker(marker, attempt, now), "final": False, "now": now}  # fmt: skip
            conn.execute(st.insert_frame, params)
            base = marker + 1
        conn.execute(st.restart, {"id": owner_id, "b_attempt": attempt, "b_base": base})
        return base

    def _resumable_in(self, conn: Connection, owner_id: str) -> bool:
        """Whether the invocation was declared ``resumable`` (``@dls.udf(resumable=True)``)."""
        run_config = conn.execute(self._frame_st.run_config, {"id": owner_id}).scalar_one_or_none()
        return isinstance(run_config, dict) and run_config.get("resumable") is True

    @retry_on_disconnect
    def append_frames(
        self,
        invocation_id: str,
        attempt: int,
        frames: Sequence[tuple[int, bytes, bool]],
        *,
        worker_id: str | None = None,
    ) -> list[ChunkResult]:
        """Journal ``frames`` (``(seq, data, final)``, in seq order) of one attempt in one
        transaction; one result per frame, as the module docstring says. A refused frame and those
        after it answer ``ok=False`` with the reason and status (UNKNOWN, ANOTHER_WORKER and
        SUPERSEDED refuse the whole batch; OUT_OF_ORDER carries ``expected_seq``)."""
        if not frames:
            return []
        req = self._prepare_frames(FramesRequest(invocation_id, attempt, list(frames), worker_id))
        with self.db.tx(write=True) as conn:
            results = self._append_frames_in(conn, req, time.time())
        if any(r.ok and not r.duplicate for r in results):
            self._notify(frame_channel(invocation_id))
        return results

    @staticmethod
    def _prepare_frames(req: FramesRequest) -> FramesRequest:
        """The checks of a batch that need no transaction (a PlaneError 400 refuses it whole)."""
        if req.invocation_id.startswith(TOPIC_PREFIX):
            raise PlaneError("topic frames are appended by topic_append, not append_frames", status=400)
        for seq, _data, _final in req.frames:
            if seq < 0:
                raise PlaneError(f"frame seq must be >= 0, got {seq}", status=400)
        return req

    def _append_frames_in(self, conn: Connection, req: FramesRequest, now: float) -> list[ChunkResult]:
        """Journal a checked batch in the caller's transaction (see ``append_frames``): the lease
        and the journal's last frame are read here, so a batch after another of the same
        invocation in one group commit sees the frames that one wrote."""
        st = self._frame_st
        invocation_id, frames = req.invocation_id, req.frames
        lease = conn.execute(st.lease, {"id": invocation_id}).first()
        if lease is None:
            reason, status = f"unknown invocation {invocation_id}", UNKNOWN
            return [ChunkResult(ok=False, seq=s, reason=reason, status=status) for s, _d, _f in frames]
        refused = lease_refusal(lease, req.attempt, req.worker_id)
        if refused is not None:
            status, reason = refused
            return [ChunkResult(ok=False, seq=s, reason=reason, status=status) for s, _d, _f in frames]
        base = self._base_in(conn, invocation_id, req.attempt, lease, now)
        return self._append_positions_in(conn, invocation_id, req.attempt, base, frames, now)

    def _append_positions_in(
        self,
        conn: Connection,
        invocation_id: str,
        attempt: int,
        base: int,
        sent: Sequence[tuple[int, bytes, bool]],
        now: float,
    ) -> list[ChunkResult]:
        """Journal ``sent`` (the attempt's own seqs) at ``base + seq``, as ``append_frames`` says;
        the results and the reasons speak the attempt's seqs (positions in ``ChunkResult.pos``)."""
        st = self._frame_st
        restamped = attempt > 1
        newest = conn.execute(st.last_frame, {"owner": invocation_id}).first()
        last = -1 if newest is None else int(newest.seq)
        journaled = last
        closed = newest is not None and bool(newest.final)
        results: list[ChunkResult] = []
        fresh: list[tuple[str, int, bytes, bool, float]] = []
        for seq, raw, final in sent:
            if seq < 0:
                raise PlaneError(f"frame seq must be >= 0, got {seq}", status=400)
            pos = base + seq
            data = restamp(raw, pos, attempt, seq) if restamped else bytes(raw)
            if pos <= journaled:  # a repeat of a journaled seq (the insert fills a legacy gap)
                params = {"owner": invocation_id, "seq": pos, "data": data, "final": bool(final), "now": now}
                added = conn.execute(st.insert_frame, params).first()
                results.append(ChunkResult(ok=True, seq=seq, duplicate=added is None, pos=pos))
                continue
            if pos <= last:  # a repeat of a frame earlier in this batch
                results.append(ChunkResult(ok=True, seq=seq, duplicate=True, pos=pos))
                continue
            why = None
            if closed:
                why = f"the stream of {invocation_id} ended with final frame {last - base}"
            elif pos != last + 1:
                why = f"frame {seq} of {invocation_id} skips ahead: the next frame is {last + 1 - base}"
            if why is not None:  # this frame and the rest are refused; what came before is kept
                reason = f"{why}; send frames in order, each once"
                results.extend(
                    ChunkResult(
                        ok=False, seq=s, reason=reason, status=OUT_OF_ORDER, expected_seq=last + 1 - base
                    )
                    for s, _d, _f in sent[len(results) :]
                )
                break
            fresh.append((invocation_id, pos, data, bool(final), now))
            results.append(ChunkResult(ok=True, seq=seq, pos=pos, data=data if restamped else None))
            last, closed = pos, bool(final)
        if fresh:
            conn.exec_driver_sql(st.insert_new_sql, fresh)
        return results

    @retry_on_disconnect
    def read_frames(self, owner_id: str, since: int = -1, limit: int = 1000) -> list[Frame]:
        params = {"owner": owner_id, "since": since, "limit": max(0, limit)}
        with self.db.tx(write=False) as conn:
            rows = conn.execute(self._frame_st.read_frames, params).fetchall()
        return [Frame(seq=int(seq), data=bytes(data), final=bool(final)) for seq, data, final in rows]

    # -- sends into two-way generators -----------------------------------------------------------

    @retry_on_disconnect
    def send_append(self, invocation_id: str, index: int, data: bytes, final: bool) -> ChunkResult:
        """Journal ``data`` (an encoded frame) as the send answering yield ``index`` of the two-way
        body of ``invocation_id`` (see the module docstring); ``final``: the consumer closed it."""
        if index < 0:
            raise PlaneError(f"send index must be >= 0, got {index}", status=400)
        st = self._frame_st
        owner = SEND_PREFIX + invocation_id
        with self.db.tx(write=True) as conn:
            lease = conn.execute(st.lease, {"id": invocation_id}).first()
            if lease is None:
                return ChunkResult(
                    ok=False, seq=index, reason=f"unknown invocation {invocation_id}", status=UNKNOWN
                )
            run_config = conn.execute(st.run_config, {"id": invocation_id}).scalar_one_or_none()
            if not (isinstance(run_config, dict) and run_config.get("two_way")):
                one_way = (
                    f"invocation {invocation_id} is not a two-way generator: its body never reads a sent "
                    "value (a generator that uses its yields, `x = yield v`, is one; or declare "
                    "@dls.udf(two_way=True)); use next() to pull its values"
                )
                return ChunkResult(ok=False, seq=index, reason=one_way, status=OUT_OF_ORDER)
            last = conn.execute(st.last_frame, {"owner": owner}).first()
            expected = 0 if last is None else int(last.seq) + 1
            if index < expected:
                return self._sent_before(conn, invocation_id, index, data, expected)
            why: str | None = None
            if lease.state not in ("queued", "running"):
                why = f"invocation {invocation_id} has ended ({lease.state}): its body takes no more sends"
            elif last is not None and last.final:
                why = f"the sends into {invocation_id} were closed"
            else:
                newest = conn.execute(st.last_frame, {"owner": invocation_id}).first()
                reach = (-1 if newest is None else int(newest.seq)) + SEND_WINDOW
                if newest is not None and newest.final:  # its END is journaled; the ack may lag
                    why = f"invocation {invocation_id} has ended its stream: its body takes no more sends"
                elif index > expected:
                    why = f"send {index} into {invocation_id} skips ahead: the next is {expected}; send in order, each once"
                elif index > reach:
                    why = (
                        f"send window full: {invocation_id} has not yielded far enough to take send "
                        f"{index} (at most {SEND_WINDOW} ahead of its stream); read its next value first"
                    )
            if why is not None:
                return ChunkResult(
                    ok=False, seq=index, reason=why, status=OUT_OF_ORDER, expected_seq=expected
                )
            params = {
                "owner": owner,
                "seq": index,
                "data": bytes(data),
                "final": bool(final),
                "now": time.time(),
            }
            if conn.execute(st.insert_frame, params).first() is None:
                # another send of this index committed since ``last`` was read (PostgreSQL reads
                # at READ COMMITTED): a repeat of it, or a different value (refused, not dropped)
                return self._sent_before(conn, invocation_id, index, data, index + 1)
        self._notify(owner)
        return ChunkResult(ok=True, seq=index)

    def _sent_before(
        self, conn: Connection, invocation_id: str, index: int, data: bytes, expected: int
    ) -> ChunkResult:
        """The answer to a send of a yield already answered: a repeat (the same bytes) or a
        different value, refused."""
        st = self._frame_st
        owner = SEND_PREFIX + invocation_id
        kept = conn.execute(st.read_frames, {"owner": owner, "since": index - 1, "limit": 1}).first()
        if kept is not None and bytes(kept.data) == bytes(data):
            return ChunkResult(ok=True, seq=index, duplicate=True)
        other = f"yield {index} of {invocation_id} was already sent a different value"
        return ChunkResult(ok=False, seq=index, reason=other, status=OUT_OF_ORDER, expected_seq=expected)

    # -- topics ----------------------------------------------------------------------------------

    def topic_post(self, name: str, body: bytes, final: bool = False) -> int:
        return self.topic_append(name, body, final).seq

    def topic_append(
        self, name: str, body: bytes, final: bool = False, *, namespace: str | None = None
    ) -> Frame:
        now = time.time()
        st = self._frame_st
        with self.db.tx(write=True) as conn:
            seq = (
                int(
                    conn.execute(
                        st.topic_next, {"name": name, "now": now, "namespace": namespace}
                    ).scalar_one()
                )
                - 1
            )
            data = msgpack.packb([FRAME_END if final else FRAME_VALUE, seq, bytes(body), {"ts": now}])
            params: dict[str, Any] = {
                "owner": TOPIC_PREFIX + name,
                "seq": seq,
                "data": data,
                "final": bool(final),
                "now": now,
            }
            conn.execute(st.topic_frame, params)
        self._notify(TOPIC_PREFIX + name)
        return Frame(seq=seq, data=data, final=bool(final))
