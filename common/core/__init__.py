"""What every RL script reads: errors and seeds, the process groups, tensor ops and attention, model files,
tokenizers and chat rendering, model loading, data and tasks, generation, forwards, scorers and rewards, the
environment contract and its episode runner, a step's `Rollout`. Imports nothing from the other folders."""
