"""Re-executing recorded requests on their recorded cache paths (``kvtrace replay``).

``recorded`` reads a run back from the database and plans what to execute; ``engine`` executes it
(in a process of its own, ``child``); ``verdicts`` turns the outcome into the reproduction count and
the counterfactual verdict, and keeps verdicts where ``kvtrace diff`` finds them.
"""
