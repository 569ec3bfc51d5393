"""Your exercises: fill in the functions of exNN_<step>.py, then check them with
`make check EX=NN` (or `check_exercise("NN")` in the step's notebook)."""
