"""The overview's charts: queue depth and throughput over the last hour, one point a minute.

Computed from the invocations themselves (``store.activity``: submit, start and finish times), so
nothing is sampled or kept beside them. An invocation waits in its queue from its submit until it
starts (or finishes without starting: a cancel); the depth of a minute is the most that waited at
once in it (one walk over the submits and starts in time order). Throughput is the calls that finished
in each minute, succeeded apart from the rest (failed, killed, timed out, cancelled).

The browser draws them with uPlot (``static/uPlot.iife.min.js``, vendored) from the JSON in each
chart's ``data-chart`` attribute, in ``static/dashboard.js``: no inline script (the dashboard's
Content-Security-Policy allows scripts from its own files only).
"""

from __future__ import annotations

import json
import math
from typing import Any

from dreamlake.lakeshore.store.activity import Activity

WINDOW_S = 3600
STEP_S = 60
QUEUES_DRAWN = 6  # the deepest queues get a line each; the rest are summed as "other"


def _points(now: float) -> list[float]:
    end = math.floor(now / STEP_S) * STEP_S + STEP_S  # the current minute's end
    return [end - WINDOW_S + i * STEP_S for i in range(WINDOW_S // STEP_S + 1)]


def depth_series(rows: list[Activity], now: float) -> dict[str, Any]:
    """The deepest each queue got in each minute (a wait of seconds between two sampled instants
    still shows), by walking its submits (+1) and starts or finishes (-1) in time order."""
    starts = _points(now)[:-1]
    first = starts[0]
    events: dict[str, list[tuple[float, int]]] = {}
    for r in rows:
        left = min((t for t in (r.started_at, r.finished_at) if t is not None), default=math.inf)
        if left < first:
            continue  # done waiting before the window: no part in it
        events.setdefault(r.queue, []).extend([(r.submitted_at, 1), (left, -1)])
    series: dict[str, list[int]] = {}
    for queue, evs in events.items():
        evs.sort(key=lambda e: (e[0], e[1]))  # at one instant, leave before arriving
        peaks = [0] * len(starts)
        depth = 0
        i = 0
        for bin_no, bin_start in enumerate(starts):
            while i < len(evs) and evs[i][0] < bin_start:  # the depth as the minute begins
                depth += evs[i][1]
                i += 1
            peak = depth
            bin_end = bin_start + STEP_S
            while i < len(evs) and evs[i][0] < bin_end:
                depth += evs[i][1]
                peak = max(peak, depth)
                i += 1
            peaks[bin_no] = peak
        if any(peaks):
            series[queue] = peaks
    ranked = sorted(series, key=lambda q: (-max(series[q]), q))
    drawn = [{"label": q, "values": series[q]} for q in ranked[:QUEUES_DRAWN]]
    rest = ranked[QUEUES_DRAWN:]
    if rest:
        drawn.append(
            {"label": "other", "values": [sum(series[q][i] for q in rest) for i in range(len(starts))]}
        )
    return {
        "title": "Queue depth (calls waiting, peak per minute)",
        "x": starts,
        "series": drawn,
        "kind": "bars",
    }


def throughput_series(rows: list[Activity], now: float) -> dict[str, Any]:
    starts = _points(now)[:-1]  # one bin a minute: [start, start + STEP_S)
    ok = [0] * len(starts)
    other = [0] * len(starts)
    first = starts[0]
    for r in rows:
        if r.finished_at is None or r.finished_at < first:
            continue
        i = int((r.finished_at - first) // STEP_S)
        if 0 <= i < len(starts):
            (ok if r.state == "succeeded" else other)[i] += 1
    return {
        "title": "Throughput (calls finished per minute)",
        "x": starts,
        "series": [{"label": "succeeded", "values": ok}, {"label": "failed or stopped", "values": other}],
        "kind": "bars",
    }


def charts(rows: list[Activity], now: float) -> list[dict[str, Any]]:
    """The overview's two charts, each with ``id`` and ``json`` (its ``data-chart`` attribute)."""
    out = []
    for chart_id, chart in (("depth", depth_series(rows, now)), ("throughput", throughput_series(rows, now))):
        out.append(
            {"id": chart_id, "title": chart["title"], "json": json.dumps(chart, separators=(",", ":"))}
        )
    return out
