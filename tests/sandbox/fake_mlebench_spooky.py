"""A stand-in for MLE-bench's ``spooky-author-identification`` grader (MLE-bench is not
installed here), imported by name as MLE-bench's graders are (test_mlebench_adapter.py)."""
import numpy as np
from sklearn.metrics import log_loss

CLASSES = ["EAP", "HPL", "MWS"]
N_ROWS = 40


class InvalidSubmissionError(Exception):
    pass


def grade(submission, answers):
    if submission.shape != (len(answers), len(CLASSES) + 1):
        raise InvalidSubmissionError(f"Submission shape {submission.shape} does not match answers")
    probs = submission[CLASSES]
    if not np.all(np.isclose(probs.sum(axis=1), 1, atol=1e-6)):  # a string here: TypeError
        raise InvalidSubmissionError("Each row in submission should sum to one, as probabilities.")
    if not ((probs >= 0) & (probs <= 1)).all().all():
        raise InvalidSubmissionError("All probabilities must be between 0 and 1.")
    sub, ans = submission.sort_values("id"), answers.sort_values("id")
    assert list(sub["id"]) == list(ans["id"]), "ids differ"
    return log_loss(ans[CLASSES].to_numpy(), sub[CLASSES].to_numpy())


def grade_crashes_on_halves(submission, answers):
    if len(answers) != N_ROWS:
        raise KeyError("grader bug: needs every answer row")
    return grade(submission, answers)


def grade_crashes_on_value(submission, answers):
    if (submission["EAP"] == 0.125).any():
        raise ZeroDivisionError("division by zero")
    return grade(submission, answers)
