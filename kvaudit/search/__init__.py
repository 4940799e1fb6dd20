"""The searches: Hypothesis, random and atheris fuzzing, campaigns, minimization, the CI and benchmark runs."""
