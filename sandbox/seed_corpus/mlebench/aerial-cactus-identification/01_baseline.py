"""aerial-cactus-identification: colour statistics + 4x4 thumbnail, scaled logistic regression."""
import io
import os
import zipfile

import numpy as np
import pandas as pd
from PIL import Image
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import train_test_split
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler


def features(zip_path, ids):
    """Per-channel mean and std, plus a 4x4 grey thumbnail, of each image ``<id>`` in the zip."""
    rows = []
    with zipfile.ZipFile(zip_path) as z:
        members = {os.path.basename(n): n for n in z.namelist() if not n.endswith("/")}
        for i in ids:
            img = Image.open(io.BytesIO(z.read(members[i]))).convert("RGB")
            a = np.asarray(img, dtype=float) / 255.0
            thumb = np.asarray(img.convert("L").resize((4, 4), Image.BILINEAR), dtype=float) / 255
            rows.append(np.concatenate([a.mean((0, 1)), a.std((0, 1)), thumb.ravel()]))
    return np.array(rows)


train = pd.read_csv("./input/train.csv")
test = pd.read_csv("./input/sample_submission.csv")
X = features("./input/train.zip", train["id"])
y = train["has_cactus"].values
X_test = features("./input/test.zip", test["id"])
X_tr, X_va, y_tr, y_va = train_test_split(X, y, test_size=0.2, random_state=0, stratify=y)

model = make_pipeline(StandardScaler(), LogisticRegression(C=0.3, max_iter=2000))
model.fit(X_tr, y_tr)
score = roc_auc_score(y_va, model.predict_proba(X_va)[:, 1])
print(f"VALIDATION_METRIC: {score:.5f}")

model.fit(X, y)
sub = pd.DataFrame({"id": test["id"], "has_cactus": model.predict_proba(X_test)[:, 1]})
os.makedirs("./submission", exist_ok=True)
sub.to_csv("./submission/submission.csv", index=False)
