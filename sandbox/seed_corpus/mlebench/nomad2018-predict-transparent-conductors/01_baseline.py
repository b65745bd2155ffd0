"""nomad2018-predict-transparent-conductors: random forests on log1p targets, csv columns."""
import os

import numpy as np
import pandas as pd
from sklearn.ensemble import RandomForestRegressor
from sklearn.metrics import root_mean_squared_log_error
from sklearn.model_selection import train_test_split

TARGETS = ["formation_energy_ev_natom", "bandgap_energy_ev"]
train = pd.read_csv("./input/train.csv")
test = pd.read_csv("./input/test.csv")


def features(df):
    X = df.drop(columns=["id"] + [t for t in TARGETS if t in df.columns])
    a, b, c = (X[f"lattice_vector_{k}_ang"] for k in (1, 2, 3))
    X["volume_per_atom"] = a * b * c / X["number_of_total_atoms"]
    for sg in (12, 33, 167, 194, 206, 227):
        X[f"sg_{sg}"] = (X["spacegroup"] == sg).astype(int)
    return X


X, Y = features(train), train[TARGETS]
X_test = features(test)


def fit_predict(X_fit, Y_fit, X_pred):
    """One forest per target, fitted on log1p (the metric is RMSLE)."""
    out = {}
    for t in TARGETS:
        m = RandomForestRegressor(n_estimators=300, min_samples_leaf=2, random_state=0)
        m.fit(X_fit, np.log1p(Y_fit[t]))
        out[t] = np.clip(np.expm1(m.predict(X_pred)), 0, None)
    return pd.DataFrame(out)


X_tr, X_va, Y_tr, Y_va = train_test_split(X, Y, test_size=0.2, random_state=0)
P_va = fit_predict(X_tr, Y_tr, X_va)
score = np.mean([root_mean_squared_log_error(Y_va[t], P_va[t]) for t in TARGETS])
print(f"VALIDATION_METRIC: {score:.5f}")

sub = fit_predict(X, Y, X_test)
sub.insert(0, "id", test["id"].to_numpy())
os.makedirs("./submission", exist_ok=True)
sub.to_csv("./submission/submission.csv", index=False)
