"""The functions ``examples/06_ship_code.py`` runs remotely; ``shiplib.fmt`` comes along with them."""

from __future__ import annotations

import dreamlake.lakeshore as dls
from shiplib import fmt


@dls.udf(queue="ship")
def summarize(values: list[float]) -> dict[str, object]:
    """Mean and spread of ``values``, and where this code ran from (nymph's code cache)."""
    mean = sum(values) / len(values)
    spread = max(values) - min(values)
    return {"summary": fmt.line(mean, spread), "ran_from": __file__}
