"""paraprop's lab: the benchmarks, demos, measurement harness and training jobs that the
``paraprop`` command drives; tooling, not API.

- :mod:`paraprop_lab.bench`: the suites of ``paraprop bench SUITE`` and ``paraprop report``;
- :mod:`paraprop_lab.demos`: the parts of ``paraprop demo``;
- :mod:`paraprop_lab.experiments`: the measurement harness both commands share (timing,
  machine record, reports, plots); it imports the training jobs, never the reverse;
- :mod:`paraprop_lab.training`: the jobs of ``paraprop train JOB``;
- :mod:`paraprop_lab.progress`: the progress bars of the harness and the training jobs;
- :mod:`paraprop_lab.cli`: the ``paraprop`` command (also ``python -m paraprop_lab``).

The lab imports the library (:mod:`paraprop`: its cores, adapters, models and data); the library
never imports the lab (``tests/test_layout.py`` checks it).
"""
