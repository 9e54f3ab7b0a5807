"""Command-line tools (`python -m tools.X`): data preparation, evaluation, preferences, inspection,
comparison of runs, export. Training scripts never import them; they use the library in common/."""
