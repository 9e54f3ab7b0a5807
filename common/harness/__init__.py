"""The run's life: flags as typed groups (args), presets and parsing (cli), checkpoints, the run and its folder
(run, tracking), training health, perf metrics, evaluation. Nothing below imports it."""
