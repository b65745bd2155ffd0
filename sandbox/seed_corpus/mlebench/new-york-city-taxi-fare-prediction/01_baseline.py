"""new-york-city-taxi-fare-prediction: random forest on trip distance and pickup time."""
import os

import numpy as np
import pandas as pd
from sklearn.ensemble import RandomForestRegressor
from sklearn.metrics import root_mean_squared_error
from sklearn.model_selection import train_test_split

train = pd.read_csv("./input/labels.csv")
test = pd.read_csv("./input/test.csv")


def features(df):
    when = pd.to_datetime(df["pickup_datetime"].str.replace(" UTC", ""))
    lat1, lon1 = np.radians(df["pickup_latitude"]), np.radians(df["pickup_longitude"])
    lat2, lon2 = np.radians(df["dropoff_latitude"]), np.radians(df["dropoff_longitude"])
    a = (np.sin((lat2 - lat1) / 2) ** 2
         + np.cos(lat1) * np.cos(lat2) * np.sin((lon2 - lon1) / 2) ** 2)
    km = 2 * 6371 * np.arcsin(np.sqrt(a))
    # rides with missing (zero) or far-off coordinates: distance unknown
    ok = df[["pickup_latitude", "dropoff_latitude"]].abs().gt(1).all(axis=1) & (km < 100)
    return pd.DataFrame({"km": np.where(ok, km, np.nan), "year": when.dt.year + when.dt.month / 12,
                         "hour": when.dt.hour, "weekday": when.dt.day_of_week,
                         "passengers": df["passenger_count"]})


X, y = features(train), train["fare_amount"]
X_test = features(test)
median_km = X["km"].median()
X, X_test = X.fillna(median_km), X_test.fillna(median_km)


def model():
    return RandomForestRegressor(n_estimators=200, min_samples_leaf=2, random_state=0)


X_tr, X_va, y_tr, y_va = train_test_split(X, y, test_size=0.2, random_state=0)
score = root_mean_squared_error(y_va, model().fit(X_tr, y_tr).predict(X_va))
print(f"VALIDATION_METRIC: {score:.5f}")

m = model().fit(X, y)
os.makedirs("./submission", exist_ok=True)
pd.DataFrame({"key": test["key"], "fare_amount": m.predict(X_test)}).to_csv(
    "./submission/submission.csv", index=False)
