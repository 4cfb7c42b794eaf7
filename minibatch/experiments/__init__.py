"""Experiments: functions that run policies through ``minibatch.experiment.run`` and return plain,
JSON-ready numbers (rows, dicts); one module per topic. The notebooks' lessons and the scripts in
``benchmarks/`` call them, so a figure and its benchmark measure the same way."""
