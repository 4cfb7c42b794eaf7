"""The course's own tooling, outside the engine package: what builds and checks the notebooks rather than what a
notebook or a user of the engine imports.

* :mod:`minibatch_course.prose`: the prose scanner (numbers in markdown backed by outputs or by
  ``minibatch.claims``; regimes of the roofline named right; builders' jargon), run by tests/test_prose.py and
  tests/test_claims.py, or ``python -m minibatch_course.prose NOTEBOOK...``;
* :mod:`minibatch_course.editions`: student and instructor editions from the notebooks' solution markers
  (``python scripts/build_editions.py``);
* :mod:`minibatch_course.concepts`: one module per concept figure (``python scripts/draw_concepts.py``).

The notebooks' printers and exercise checks stay in ``minibatch.lessons``. Installed by the same
``pip install -e .`` as ``minibatch``.
"""
