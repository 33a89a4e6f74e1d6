"""The reports, as library code the Kedro nodes call: tables, statistics and figures from plain
frames and histories, nothing saved or logged here.

* :mod:`.training`: the default chain's report (``report`` pipeline): training curves per method and
  the held-out comparison;
* :mod:`.compare`: ``make compare``'s seeded comparison: intervals, paired differences, the design's
  power, mechanism metrics and curves;
* :mod:`.tables`: markdown tables shared by both.
"""
