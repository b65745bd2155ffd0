"""siim-isic-melanoma-classification: lesion colour/size + metadata, logistic regression."""
import os

import numpy as np
import pandas as pd
from PIL import Image
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import train_test_split
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

SITES = ["torso", "lower extremity", "upper extremity", "head/neck", "palms/soles", "oral/genital"]


def image_features(path):
    img = np.asarray(Image.open(path).convert("RGB").resize((32, 32)), dtype=float) / 255
    px = img.reshape(-1, 3)
    brightness = px.mean(1)
    lesion = brightness < np.median(brightness) - 0.15  # darker than the surrounding skin
    inside = px[lesion] if lesion.any() else px
    bluish = (px[:, 2] > px[:, 0]).mean()
    return np.concatenate([px.mean(0), px.std(0), inside.mean(0), inside.std(0),
                           [lesion.mean(), bluish]])


def meta_features(df):
    return np.column_stack([
        df["age_approx"].fillna(df["age_approx"].median()).to_numpy(float),
        (df["sex"] == "male").to_numpy(float),
        *[(df["anatom_site_general_challenge"] == s).to_numpy(float) for s in SITES]])


train = pd.read_csv("./input/train.csv")
test = pd.read_csv("./input/test.csv")
X = np.column_stack([np.stack([image_features(f"./input/jpeg/train/{n}.jpg")
                               for n in train["image_name"]]), meta_features(train)])
y = train["target"].to_numpy()
X_test = np.column_stack([np.stack([image_features(f"./input/jpeg/test/{n}.jpg")
                                    for n in test["image_name"]]), meta_features(test)])
model = make_pipeline(StandardScaler(), LogisticRegression(C=0.3, max_iter=2000))

X_tr, X_va, y_tr, y_va = train_test_split(X, y, test_size=0.2, random_state=0, stratify=y)
model.fit(X_tr, y_tr)
print(f"VALIDATION_METRIC: {roc_auc_score(y_va, model.predict_proba(X_va)[:, 1]):.5f}")

model.fit(X, y)
sub = pd.DataFrame({"image_name": test["image_name"], "target": model.predict_proba(X_test)[:, 1]})
os.makedirs("./submission", exist_ok=True)
sub.to_csv("./submission/submission.csv", index=False)
