"""Measurements shared by ``paraprop bench`` (full sizes, recorded) and ``paraprop demo`` (small
sizes, explained).

- :mod:`~paraprop_lab.experiments.harness`: interleaved timing, machine info, thread control;
- :mod:`~paraprop_lab.experiments.report`: tables and the JSON/Markdown result writer;
- :mod:`~paraprop_lab.experiments.plots`: shared figures;
- :mod:`~paraprop_lab.experiments.explain`: the sentence that ends each demo section (which method
  won on this machine and why, from the measured counts);
- :mod:`~paraprop_lab.experiments.compare`: one reference solve and one traced solve per method;
- one module per topic (``made``, ``decoding``, ``diffusion``, ``tarflow``, ``networks``,
  ``core``, ``bppsa``): the measurement both commands run, on problems built from
  :mod:`paraprop.models` and :mod:`paraprop.data`.

Tooling, not API: the suites live in :mod:`paraprop_lab.bench` (a leaf: nothing imports it but the
CLI), the demo parts in :mod:`paraprop_lab.demos`. The measurements import the training jobs
(:mod:`paraprop_lab.training`: the models they measure), never the reverse; the progress bars both
use are :mod:`paraprop_lab.progress`.
"""
