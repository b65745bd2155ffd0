"""A procedural MLE task family: hundreds of tiny, deterministic tabular tasks with varied schemas.

An instance is a (generator kind, index) pair, registered as ``proc-<kind>-<index:03d>`` (e.g.
``proc-linear-007``). Everything about it is a pure function of that pair (numpy ``Generator``s
seeded with ``[kind code, index, stream]``): the schema (theme, column names and their case
style, column types, id column name and id style, target name and type, labels, metric, row
count, missing values, noise), the data, and the description's wording. ``prepare(out_dir,
seed)`` writes MLE-bench's layout exactly as the offline suite does (same ``Task`` record, same
grader, same metric registry, the same trivial sample submission); the prepare ``seed`` (the
run's ``tasks.seed``, 0 for the committed leaderboards) only moves the train / test / dev split
and the id values, as it does for the offline suite.

Generator kinds (``KINDS``), each drawing binary, multiclass or regression targets:

  * ``linear``:   a linear / logistic model with pairwise interactions and categorical effects;
  * ``rules``:    tree-like threshold rules (a random full binary tree of depth 2-4), label noise;
  * ``clusters``: Gaussian clusters per class (multiclass, sometimes binary), label noise;
  * ``counts``:   overdispersed counts (Poisson-Gamma) with heavy noise, regression metrics;
  * ``tokens``:   a text-like column of synthetic tokens with class-dependent frequencies
    (classification), plus a few numeric columns. **Held out as a family** (``HELDOUT_KINDS``).

Splits (``instance_split``, ``split_ids``):

  * ``heldout_family``: every instance of a kind in ``HELDOUT_KINDS``;
  * ``heldout``: an instance of a training kind whose id hashes (sha256 of the id, first 8 hex
    digits / 2**32) below ``HELDOUT_FRACTION``. The rule depends on the id alone, so adding
    instances never moves an existing one between splits;
  * ``train``: the rest. Only these have seed scripts (``sandbox.seed_corpus.list_scripts``), so
    the SFT corpus is built from training instances only.

Every instance has baseline scripts (``sandbox.seed_corpus.procedural.baseline_scripts``) that
``python -m sandbox.procedural_sweep`` runs through the sandbox pool; its one compact output,
``sandbox/seed_corpus/results/seed0/procedural.csv``, holds every instance's reference
leaderboard (``reference_leaderboard``) and a digest of the prepared files
(``prepared_digest``) the scores were measured on.

Rows: 60 to 3000 (at least 120 for binary and 200 for multiclass targets, so that both test
halves hold every class); an execution of a baseline takes well under a second once the
libraries are imported.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import pathlib
from typing import Optional

import numpy as np
import pandas as pd

from sandbox import grading
from sandbox.tasks import base, registry
from sandbox.tasks.offline_suite import _split, _submission_layout, _to_csv, _trivial_prediction

FAMILY = "procedural"
PREFIX = "proc"
KINDS = ("linear", "rules", "clusters", "counts", "tokens")
HELDOUT_KINDS = ("tokens",)
TRAIN_KINDS = tuple(k for k in KINDS if k not in HELDOUT_KINDS)
INSTANCES_PER_KIND = 48
HELDOUT_FRACTION = 0.2
SPLITS = ("train", "heldout", "heldout_family")
_KIND_CODE = {"linear": 11, "rules": 12, "clusters": 13, "counts": 14, "tokens": 15}

RESULTS_FILE = registry.RESULTS_DIR / "seed{seed}" / "procedural.csv"
TIME_LIMIT_S = 30.0
MEMORY_LIMIT_MB = 1024


# ------------------------------------------------------------------------------------------------
# Ids and splits
# ------------------------------------------------------------------------------------------------

def make_task_id(kind: str, index: int) -> str:
    """``proc-<kind>-<index:03d>``."""
    if kind not in KINDS:
        raise ValueError(f"unknown generator kind {kind!r}; known: {KINDS}")
    return f"{PREFIX}-{kind}-{int(index):03d}"


def parse_task_id(task_id: str) -> tuple[str, int]:
    """(kind, index) of a procedural id; ValueError for anything else."""
    parts = task_id.split("-")
    if len(parts) != 3 or parts[0] != PREFIX or parts[1] not in KINDS or not parts[2].isdigit():
        raise ValueError(f"not a procedural task id: {task_id!r} (expected {PREFIX}-<kind>-NNN, "
                         f"kind in {KINDS})")
    return parts[1], int(parts[2])


def is_procedural(task_id: str) -> bool:
    """Whether ``task_id`` names a procedural instance (registered or not)."""
    try:
        parse_task_id(task_id)
        return True
    except ValueError:
        return False


def all_ids() -> list[str]:
    """Every registered instance id, sorted."""
    return sorted(make_task_id(k, i) for k in KINDS for i in range(INSTANCES_PER_KIND))


def instance_split(task_id: str) -> str:
    """"train", "heldout" (an instance of a training kind held out by its id's hash) or
    "heldout_family" (an instance of a held-out kind)."""
    kind, _ = parse_task_id(task_id)
    if kind in HELDOUT_KINDS:
        return "heldout_family"
    h = int(hashlib.sha256(task_id.encode()).hexdigest()[:8], 16) / 2**32
    return "heldout" if h < HELDOUT_FRACTION else "train"


def split_ids(split: str) -> list[str]:
    """The sorted registered ids of ``split`` (one of ``SPLITS``, or "all")."""
    if split == "all":
        return all_ids()
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS} or 'all', got {split!r}")
    return [t for t in all_ids() if instance_split(t) == split]


def is_training_instance(task_id: str) -> bool:
    """True for a procedural id of the "train" split."""
    return is_procedural(task_id) and instance_split(task_id) == "train"


# ------------------------------------------------------------------------------------------------
# Themes: the vocabulary the schemas are drawn from
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Theme:
    name: str
    titles: tuple[str, ...]
    entity: str
    numeric: tuple[str, ...]
    categorical: tuple[tuple[str, tuple[str, ...]], ...]
    binary: tuple[tuple[str, tuple[str, str]], ...]
    multiclass: tuple[tuple[str, tuple[str, ...]], ...]
    regression: tuple[str, ...]
    counts: tuple[str, ...]
    text: tuple[str, ...]


THEMES = (
    Theme("retail", ("customer behaviour", "shop analytics", "store customers"), "customer",
          ("age", "tenure_months", "monthly_spend", "visits_last_30d", "basket_size",
           "discount_rate", "support_calls", "days_since_last_order", "loyalty_points",
           "avg_session_min", "returns_count", "email_open_rate", "pages_per_visit",
           "distance_to_store_km", "items_viewed"),
          (("region", ("north", "south", "east", "west", "central")),
           ("plan", ("basic", "plus", "premium")), ("channel", ("web", "app", "store", "phone")),
           ("payment", ("card", "cash", "voucher", "transfer"))),
          (("churned", ("no", "yes")), ("responded", ("no", "yes")),
           ("upgraded", ("stayed", "upgraded"))),
          (("segment", ("bargain", "loyal", "occasional", "premium", "new")),
           ("preferred_category", ("food", "garden", "toys", "clothing", "electronics", "books"))),
          ("annual_value", "next_month_spend", "basket_value"),
          ("orders_next_quarter", "complaints"), ("search_terms", "review_words")),
    Theme("manufacturing", ("production line quality", "factory sensors", "machining runs"), "part",
          ("temperature_c", "pressure_kpa", "spindle_speed_rpm", "vibration_mm_s", "humidity_pct",
           "torque_nm", "cycle_time_s", "tool_wear_min", "voltage_v", "current_a",
           "coolant_flow_lpm", "line_speed", "shift_hours", "operator_experience_yr",
           "ambient_temp_c"),
          (("machine", ("m1", "m2", "m3", "m4", "m5", "m6")), ("shift", ("day", "swing", "night")),
           ("supplier", ("acme", "borg", "cygnus", "delta")),
           ("material", ("steel", "alloy", "polymer", "composite"))),
          (("defective", ("ok", "defect")), ("failed_inspection", ("pass", "fail"))),
          (("defect_type", ("no_defect", "scratch", "crack", "warp", "porosity")),
           ("quality_grade", ("A", "B", "C", "D"))),
          ("yield_pct", "scrap_kg", "surface_roughness"),
          ("defects_found", "stoppages"), ("maintenance_log", "alarm_codes")),
    Theme("agriculture", ("crop field trials", "farm plots", "harvest records"), "plot",
          ("rainfall_mm", "soil_ph", "nitrogen_ppm", "phosphorus_ppm", "potassium_ppm",
           "elevation_m", "slope_deg", "sunshine_hours", "irrigation_mm", "seed_density",
           "organic_matter_pct", "temperature_mean_c", "frost_days", "plot_area_ha",
           "previous_yield_t"),
          (("soil_type", ("clay", "loam", "sand", "silt", "peat")),
           ("crop", ("wheat", "maize", "barley", "soy")),
           ("tillage", ("no_till", "minimal", "full")),
           ("county", ("alder", "birch", "cedar", "dogwood", "elm"))),
          (("disease_present", ("no", "yes")), ("crop_failure", ("no", "yes"))),
          (("yield_class", ("low", "medium", "high")),
           ("dominant_weed", ("thistle", "dock", "nettle", "clover"))),
          ("yield_t_ha", "protein_pct", "grain_moisture"),
          ("pest_count", "weed_count"), ("observation_tags", "scout_notes")),
    Theme("health", ("clinic outcomes", "patient records", "health screening"), "patient",
          ("age_years", "bmi", "systolic_bp", "diastolic_bp", "heart_rate", "glucose_mg_dl",
           "cholesterol_mg_dl", "hdl", "ldl", "triglycerides", "creatinine", "steps_per_day",
           "sleep_hours", "alcohol_units_week", "hemoglobin"),
          (("sex", ("female", "male")), ("smoker", ("never", "former", "current")),
           ("activity_level", ("low", "moderate", "high")),
           ("insurance", ("public", "private", "uninsured"))),
          (("readmitted", ("no", "yes")), ("diabetic", ("negative", "positive"))),
          (("risk_tier", ("low", "elevated", "high", "critical")),
           ("diagnosis_group", ("cardiac", "metabolic", "respiratory", "renal", "other"))),
          ("hba1c", "recovery_days", "treatment_cost"),
          ("er_visits", "prescriptions"), ("symptom_codes", "triage_notes")),
    Theme("logistics", ("parcel deliveries", "freight shipments", "courier network"), "shipment",
          ("distance_km", "weight_kg", "volume_m3", "declared_value", "num_items", "lead_time_days",
           "fuel_price", "carrier_rating", "stops", "driver_hours", "temperature_c",
           "packaging_layers", "route_congestion", "warehouse_load_pct", "order_hour"),
          (("carrier", ("swift", "atlas", "orbit", "relay", "zenith")),
           ("service_level", ("economy", "standard", "express", "overnight")),
           ("origin_hub", ("hub_a", "hub_b", "hub_c", "hub_d")),
           ("vehicle", ("van", "truck", "bike", "rail"))),
          (("late_delivery", ("on_time", "late")), ("damaged", ("no", "yes"))),
          (("delay_bucket", ("on_time", "minor", "major")),
           ("exception_type", ("address", "weather", "customs", "capacity", "lost"))),
          ("delivery_cost", "transit_hours", "co2_kg"),
          ("damaged_items", "delivery_attempts"), ("status_tags", "scan_events")),
    Theme("energy", ("building energy use", "smart meters", "facility consumption"), "building",
          ("floor_area_m2", "year_built", "occupants", "outdoor_temp_c", "insulation_score",
           "window_ratio", "hvac_age_years", "solar_kw", "hours_open", "humidity_pct", "wind_speed",
           "cloud_cover", "setpoint_c", "num_floors", "appliance_count"),
          (("building_type", ("office", "retail", "school", "residential", "warehouse")),
           ("heating", ("gas", "electric", "heat_pump", "district")),
           ("climate_zone", ("z1", "z2", "z3", "z4", "z5")), ("orientation", ("n", "e", "s", "w"))),
          (("peak_alert", ("no", "yes")), ("meter_fault", ("no", "yes"))),
          (("efficiency_label", ("A", "B", "C", "D", "E")),
           ("load_profile", ("flat", "morning", "evening", "night"))),
          ("daily_kwh", "peak_kw", "gas_m3"),
          ("outage_events", "alarm_count"), ("alarm_log", "event_tags")),
    Theme("finance", ("loan applications", "credit portfolio", "lending decisions"), "applicant",
          ("income_k", "loan_amount_k", "debt_to_income", "credit_history_yr", "open_accounts",
           "utilization_pct", "late_payments", "employment_yr", "savings_k", "age",
           "inquiries_6m", "term_months", "interest_rate", "num_dependents", "collateral_value_k"),
          (("home_ownership", ("rent", "own", "mortgage")),
           ("purpose", ("car", "home", "education", "business", "debt"))),
          (("defaulted", ("no", "yes")), ("approved", ("rejected", "approved"))),
          (("credit_band", ("poor", "fair", "good", "excellent")),
           ("product", ("card", "personal", "auto", "mortgage"))),
          ("approved_limit_k", "recovery_rate", "expected_loss"),
          ("missed_payments", "card_transactions"), ("transaction_tags", "memo_words")),
    Theme("ecology", ("stream surveys", "wildlife monitoring", "field ecology"), "site",
          ("water_temp_c", "dissolved_oxygen", "turbidity_ntu", "ph", "canopy_cover_pct",
           "altitude_m", "distance_to_road_km", "stream_width_m", "flow_rate", "nitrate_mg_l",
           "conductivity", "depth_m", "substrate_size_mm", "survey_minutes", "observer_years"),
          (("habitat", ("forest", "wetland", "grassland", "urban", "riparian")),
           ("season", ("spring", "summer", "autumn", "winter")),
           ("survey_method", ("visual", "trap", "acoustic")),
           ("watershed", ("upper", "middle", "lower"))),
          (("species_present", ("absent", "present")), ("invasive_found", ("no", "yes"))),
          (("dominant_taxon", ("mayfly", "stonefly", "caddisfly", "midge", "snail")),
           ("health_class", ("poor", "fair", "good"))),
          ("biomass_g", "species_richness_index", "water_quality_score"),
          ("individuals_counted", "nests_found"), ("field_notes", "call_codes")),
)

ID_NAMES = ("id", "row_id", "{entity}_id", "ID", "Id", "uid", "record_id", "key")
GENERIC_PREFIXES = ("f", "x", "feat_", "var_", "col", "V", "attr_", "m")
SYLLABLES = ("ka", "lo", "mi", "ra", "tu", "se", "no", "vi", "de", "po", "zu", "ba", "ke", "fi",
             "go", "ha", "ju", "le", "mo", "ne", "pi", "qu", "ri", "sa", "to", "wy")


# ------------------------------------------------------------------------------------------------
# The instance spec (schema) and the data
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Column:
    """One feature column: ``ftype`` in {"num", "int", "cat", "text"}; ``levels`` for "cat"."""
    name: str
    ftype: str
    informative: bool
    missing: float = 0.0
    levels: tuple[str, ...] = ()
    decimals: int = 2
    scale: float = 1.0
    offset: float = 0.0
    skew: float = 0.0


def _case(name: str, style: str) -> str:
    parts = [p for p in name.split("_") if p]
    if style == "camel":
        return parts[0].lower() + "".join(p[:1].upper() + p[1:] for p in parts[1:])
    if style == "pascal":
        return "".join(p[:1].upper() + p[1:] for p in parts)
    if style == "upper":
        return "_".join(p.upper() for p in parts)
    if style == "dash":
        return "-".join(parts)
    return "_".join(parts)


@dataclasses.dataclass(frozen=True)
class InstanceSpec:
    """The schema of one instance (a pure function of kind and index; see ``make_spec``)."""

    task_id: str
    kind: str
    index: int
    theme: str
    title: str
    entity: str
    n_rows: int
    train_fraction: float
    id_column: str
    id_style: str
    target: str
    target_type: str                 # binary | multiclass | regression
    labels: Optional[tuple[str, ...]]  # classification labels as written in train.csv
    metric: str
    columns: tuple[Column, ...]
    noise: float                     # kind-specific noise level in [0, 1]
    case_style: str
    wording: int                     # which description template

    @property
    def metric_info(self) -> grading.Metric:
        return grading.get_metric(self.metric)

    @property
    def feature_names(self) -> list[str]:
        return [c.name for c in self.columns]

    def names_of(self, *ftypes: str) -> list[str]:
        return [c.name for c in self.columns if c.ftype in ftypes]

    @property
    def text_column(self) -> Optional[str]:
        t = self.names_of("text")
        return t[0] if t else None

    @property
    def has_missing(self) -> bool:
        return any(c.missing > 0 for c in self.columns)


def _rng(kind: str, index: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([_KIND_CODE[kind], int(index), stream])


def _pick(rng: np.random.Generator, seq, k: Optional[int] = None):
    if k is None:
        return seq[int(rng.integers(len(seq)))]
    return [seq[i] for i in rng.choice(len(seq), size=k, replace=False)]


def _weighted(rng: np.random.Generator, options: dict):
    keys = list(options)
    p = np.array([options[k] for k in keys], dtype=float)
    return keys[int(rng.choice(len(keys), p=p / p.sum()))]


_TARGET_TYPES = {
    "linear": {"binary": 0.5, "regression": 0.35, "multiclass": 0.15},
    "rules": {"binary": 0.35, "multiclass": 0.3, "regression": 0.35},
    "clusters": {"multiclass": 0.8, "binary": 0.2},
    "counts": {"regression": 1.0},
    "tokens": {"binary": 0.5, "multiclass": 0.5},
}
_METRICS = {
    "binary": {"auc": 0.4, "log_loss": 0.25, "accuracy": 0.2, "macro_f1": 0.15},
    "multiclass": {"log_loss": 0.4, "accuracy": 0.3, "macro_f1": 0.3},
    "regression": {"rmse": 0.45, "mae": 0.35, "rmsle": 0.2},
    "counts": {"rmse": 0.35, "mae": 0.3, "rmsle": 0.35},
}
_MIN_ROWS = {"binary": 120, "multiclass": 200, "regression": 60}


@functools.lru_cache(maxsize=None)
def make_spec(kind: str, index: int) -> InstanceSpec:
    """The schema of instance (kind, index); deterministic."""
    tid = make_task_id(kind, index)
    rng = _rng(kind, index, 1)
    theme = _pick(rng, THEMES)
    target_type = _weighted(rng, _TARGET_TYPES[kind])
    n_min = _MIN_ROWS[target_type]
    n_rows = int(round(np.exp(rng.uniform(np.log(n_min), np.log(3000)))))
    case_style = _weighted(rng, {"snake": 0.5, "camel": 0.2, "pascal": 0.1, "upper": 0.1,
                                 "dash": 0.1})
    generic = rng.random() < 0.3
    gprefix = _pick(rng, GENERIC_PREFIXES)

    # target
    labels: Optional[tuple[str, ...]] = None
    if target_type == "binary":
        target, pair = _pick(rng, theme.binary)
        metric = _weighted(rng, _METRICS["binary"])
        labels = ("0", "1") if (metric == "auc" or rng.random() < 0.3) else tuple(pair)
    elif target_type == "multiclass":
        target, names = _pick(rng, theme.multiclass)
        k_max = len(names)
        k = int(rng.integers(3, k_max + 1))
        style = _weighted(rng, {"names": 0.6, "ints": 0.2, "class": 0.2})
        if style == "names":
            labels = tuple(names[:k])
        elif style == "ints":
            labels = tuple(str(i) for i in range(k))
        else:
            labels = tuple(f"class_{chr(ord('a') + i)}" for i in range(k))
        metric = _weighted(rng, _METRICS["multiclass"])
    else:
        target = _pick(rng, theme.counts if kind == "counts" else theme.regression)
        metric = _weighted(rng, _METRICS["counts" if kind == "counts" else "regression"])

    # features
    n_num = int(rng.integers(2, 9 if kind != "tokens" else 4))
    n_noise = int(rng.integers(0, 5))
    n_cat = int(rng.integers(0, 3 if kind != "tokens" else 2))
    num_names = _pick(rng, theme.numeric, min(n_num + n_noise, len(theme.numeric)))
    cats = _pick(rng, theme.categorical, min(n_cat, len(theme.categorical)))
    cols: list[Column] = []
    for j, name in enumerate(num_names):
        informative = j < n_num
        ftype = "int" if rng.random() < 0.25 else "num"
        cols.append(Column(name, ftype, informative, decimals=int(rng.integers(1, 4)),
                           scale=float(np.exp(rng.uniform(-1, 4))),
                           offset=float(rng.choice([0.0, rng.uniform(-50, 200)])),
                           skew=float(rng.choice([0.0, 0.0, rng.uniform(0.3, 0.9)]))))
    for name, levels in cats:
        k = int(rng.integers(2, len(levels) + 1))
        cols.append(Column(name, "cat", bool(rng.random() < 0.7), levels=tuple(levels[:k])))
    if kind == "tokens":
        cols.append(Column(_pick(rng, theme.text), "text", True))
    # missing values: half of the instances, in 1-3 numeric / categorical columns
    if rng.random() < 0.5:
        cand = [i for i, c in enumerate(cols) if c.ftype != "text"]
        for i in rng.choice(cand, size=min(len(cand), int(rng.integers(1, 4))), replace=False):
            cols[int(i)] = dataclasses.replace(cols[int(i)], missing=float(rng.uniform(0.02, 0.25)))
    order = rng.permutation(len(cols))
    cols = [cols[int(i)] for i in order]
    if generic:
        width = 2 if len(cols) > 9 else 1
        cols = [dataclasses.replace(c, name=f"{gprefix}{i:0{width}d}") if c.ftype != "text" else c
                for i, c in enumerate(cols)]
    cols = [dataclasses.replace(c, name=_case(c.name, case_style)) for c in cols]
    raw_id = _pick(rng, ID_NAMES).format(entity=theme.entity)
    id_column = _case(raw_id, case_style) if raw_id.islower() else raw_id
    target = _case(target, case_style)
    names = {c.name for c in cols}
    if target in names:
        target = _case(f"{target}_target", case_style)
    if id_column in names or id_column == target:
        id_column = "row_key"
    return InstanceSpec(
        task_id=tid, kind=kind, index=int(index), theme=theme.name, title=_pick(rng, theme.titles),
        entity=theme.entity, n_rows=n_rows, train_fraction=float(rng.uniform(0.5, 0.75)),
        id_column=id_column, id_style=_weighted(rng, {"hex": 0.4, "int": 0.35, "prefixed": 0.25}),
        target=target, target_type=target_type, labels=labels, metric=metric, columns=tuple(cols),
        noise=float(rng.uniform(0.1, 0.9)), case_style=case_style,
        wording=int(rng.integers(0, 3)))


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _standardise(f: np.ndarray) -> np.ndarray:
    s = f.std()
    return (f - f.mean()) / (s if s > 0 else 1.0)


def _class_from_scores(rng, scores: np.ndarray, temperature: float) -> np.ndarray:
    """Samples a class per row from softmax(scores / temperature); scores [n, K]."""
    z = scores / max(temperature, 1e-3)
    z = z - z.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    u = rng.random((len(p), 1))
    return np.minimum((p.cumsum(axis=1) < u).sum(axis=1), p.shape[1] - 1)


def _balance(rng, y: np.ndarray, k: int, min_frac: float) -> np.ndarray:
    """Relabels random rows so that every class holds at least ``min_frac`` of the rows."""
    y = y.copy()
    need = int(np.ceil(min_frac * len(y)))
    for c in range(k):
        short = need - int((y == c).sum())
        if short > 0:
            counts = np.bincount(y, minlength=k)
            donors = np.flatnonzero(y == int(np.argmax(counts)))
            y[rng.choice(donors, size=short, replace=False)] = c
    return y


def _latent(spec: InstanceSpec, rng) -> tuple[np.ndarray, list[np.ndarray]]:
    """Latent standard-normal numeric matrix [n, p] (correlated) and categorical codes."""
    n = spec.n_rows
    nums = [c for c in spec.columns if c.ftype in ("num", "int")]
    p = len(nums)
    a = rng.normal(size=(p, p)) * rng.uniform(0, 0.5)
    cov = np.eye(p) + a @ a.T
    L = np.linalg.cholesky(cov)
    z = rng.normal(size=(n, p)) @ L.T
    z = (z - z.mean(0)) / z.std(0)
    codes = []
    for c in spec.columns:
        if c.ftype == "cat":
            w = rng.dirichlet(np.full(len(c.levels), 2.0))
            codes.append(rng.choice(len(c.levels), size=n, p=w))
    return z, codes


def _signal(spec: InstanceSpec, rng, z: np.ndarray, codes: list[np.ndarray], k: int) -> np.ndarray:
    """Kind-specific noiseless scores [n, k] from the informative features."""
    nums = [c for c in spec.columns if c.ftype in ("num", "int")]
    cats = [c for c in spec.columns if c.ftype == "cat"]
    inf = [j for j, c in enumerate(nums) if c.informative]
    cat_inf = [j for j, c in enumerate(cats) if c.informative]
    n = spec.n_rows
    out = np.zeros((n, k))
    if spec.kind in ("linear", "counts", "tokens"):
        for col in range(k):
            beta = rng.normal(size=len(inf)) * rng.choice([0.3, 1.0], size=len(inf))
            f = z[:, inf] @ beta if inf else np.zeros(n)
            for _ in range(int(rng.integers(1, 4)) if len(inf) >= 2 else 0):
                i, j = rng.choice(inf, size=2, replace=False)
                f += rng.normal() * z[:, i] * z[:, j]
            if spec.kind == "counts" and inf:
                i = int(rng.choice(inf))
                f += 0.5 * np.abs(z[:, i])
            for j in cat_inf:
                f += rng.normal(scale=0.8, size=len(cats[j].levels))[codes[j]]
            out[:, col] = _standardise(f)
        return out
    if spec.kind == "rules":
        depth = int(rng.integers(2, 5))
        feats = np.column_stack([z[:, inf]] + [codes[j][:, None] + rng.normal(0, 1e-6, (n, 1))
                                               for j in cat_inf]) if (inf or cat_inf) else z
        n_nodes = 2**depth - 1
        node_feat = rng.integers(0, feats.shape[1], size=n_nodes)
        q = rng.uniform(0.2, 0.8, size=n_nodes)
        node_thr = np.array([np.quantile(feats[:, node_feat[i]], q[i]) for i in range(n_nodes)])
        node = np.zeros(n, dtype=np.int64)
        for _ in range(depth):
            go = feats[np.arange(n), node_feat[node]] > node_thr[node]
            node = 2 * node + 1 + go
        leaf = node - n_nodes
        leaf_vals = rng.normal(size=(2**depth, k)) * 2.0
        out = leaf_vals[leaf]
        if k == 1:
            out[:, 0] = _standardise(out[:, 0])
        return out
    # clusters: class centres in the informative dims, 1-2 centres per class
    dims = inf or list(range(z.shape[1]))
    sep = rng.uniform(0.8, 2.5)
    centres = rng.normal(size=(k, 2, len(dims))) * sep
    return np.stack([-np.min(((z[:, dims][:, None, :] - centres[c][None]) ** 2).sum(-1), axis=1)
                     for c in range(k)], axis=1)


def _tokens(spec: InstanceSpec, rng, y: np.ndarray, k: int) -> np.ndarray:
    """Space-separated synthetic tokens with class-dependent frequencies, one string per row."""
    v = int(rng.integers(30, 200))
    vocab = sorted({"".join(rng.choice(SYLLABLES, size=int(rng.integers(2, 4))))
                    for _ in range(v * 2)})[:v]
    vocab = np.array(vocab, dtype=object)
    background = rng.dirichlet(np.full(len(vocab), 0.5))
    strength = 1.0 - 0.8 * spec.noise
    topic = [rng.dirichlet(np.full(len(vocab), 0.1)) for _ in range(k)]
    lengths = np.maximum(1, rng.poisson(rng.uniform(4, 16), size=len(y)))
    out = []
    for yi, ln in zip(y, lengths):
        p = (1 - strength) * background + strength * 0.5 * topic[yi] + strength * 0.5 * background
        out.append(" ".join(rng.choice(vocab, size=int(ln), p=p / p.sum())))
    return np.array(out, dtype=object)


def generate_table(spec: InstanceSpec) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(features [n, f], target [n, 1]) of an instance, before splitting; deterministic."""
    rng = _rng(spec.kind, spec.index, 2)
    z, codes = _latent(spec, rng)
    n = spec.n_rows
    if spec.target_type == "regression":
        f = _signal(spec, rng, z, codes, 1)[:, 0]
        if spec.kind == "counts":
            mu = np.exp(rng.uniform(0.0, 2.5) + rng.uniform(0.3, 1.0) * f)
            shape = 0.5 + 5.0 * (1.0 - spec.noise)
            y = rng.poisson(mu * rng.gamma(shape, 1.0 / shape, size=n)).astype(np.float64)
        else:
            y = f + rng.normal(size=n) * (0.2 + 1.5 * spec.noise)
            scale, offset = float(np.exp(rng.uniform(0, 5))), float(rng.uniform(0, 100))
            y = y * scale + offset
            if spec.metric == "rmsle":
                y = y - y.min() + float(rng.uniform(0, 5))
            y = np.round(y, 3)
        target = pd.DataFrame({spec.target: y})
    else:
        k = len(spec.labels)
        if spec.kind == "tokens":
            y = _balance(rng, rng.choice(k, size=n, p=rng.dirichlet(np.full(k, 3.0))), k,
                         0.12 if k == 2 else 0.08)
        else:
            s = _signal(spec, rng, z, codes, k)
            if k == 2 and spec.kind == "linear":
                s[:, 1] = 0.0
            y = _class_from_scores(rng, s, temperature=0.15 + 1.2 * spec.noise)
            flip = rng.random(n) < 0.1 * spec.noise
            y[flip] = rng.integers(0, k, size=int(flip.sum()))
            y = _balance(rng, y, k, 0.12 if k == 2 else 0.08)
        labels = np.array(spec.labels, dtype=object)
        target = pd.DataFrame({spec.target: labels[y] if spec.labels != ("0", "1")
                               else y.astype(np.int64)})

    feats = {}
    nums = iter(range(z.shape[1]))
    cats = iter(codes)
    for c in spec.columns:
        if c.ftype in ("num", "int"):
            v = z[:, next(nums)]
            if c.skew:
                v = np.exp(c.skew * v)
            scale = max(c.scale, 5.0) if c.ftype == "int" else c.scale
            v = c.offset + scale * v
            decimals = max(c.decimals, int(np.ceil(-np.log10(scale / 50.0))))
            v = np.round(v) if c.ftype == "int" else np.round(v, decimals)
            col = pd.Series(v)
            if c.ftype == "int":
                col = col.astype("Int64")
        elif c.ftype == "cat":
            col = pd.Series(np.array(c.levels, dtype=object)[next(cats)], dtype=object)
        else:
            yi = (pd.Categorical(target.iloc[:, 0].astype(str), categories=list(spec.labels)).codes
                  if spec.labels else np.zeros(n, dtype=int))
            col = pd.Series(_tokens(spec, rng, np.asarray(yi), len(spec.labels or (0,))),
                            dtype=object)
        if c.missing > 0:
            col = col.mask(rng.random(n) < c.missing)
        feats[c.name] = col
    return pd.DataFrame(feats), target


def _make_ids(spec: InstanceSpec, rng, n: int) -> np.ndarray:
    if spec.id_style == "int":
        return np.array([str(v) for v in rng.choice(np.arange(100_000, 1_000_000), size=n,
                                                    replace=False)], dtype=object)
    if spec.id_style == "prefixed":
        pre = spec.entity[:3].upper()
        return np.array([f"{pre}-{v}" for v in rng.choice(np.arange(10_000, 100_000), size=n,
                                                           replace=False)], dtype=object)
    seen: list[str] = []
    got: set[str] = set()
    while len(seen) < n:
        for v in rng.integers(0, 2**32, size=n - len(seen), dtype=np.uint64):
            s = f"{int(v):08x}"
            if s not in got and not s.isdigit():   # all-digit hex would read back as a number
                got.add(s)
                seen.append(s)
    return np.array(seen[:n], dtype=object)


# ------------------------------------------------------------------------------------------------
# Description
# ------------------------------------------------------------------------------------------------

_METRIC_TEXT = {
    "accuracy": ("accuracy", "the share of rows whose predicted label is exactly right"),
    "macro_f1": ("macro-averaged F1", "the unweighted mean over the classes of each class's F1"),
    "log_loss": ("multi-class log loss", "natural log; each row of probabilities is divided by "
                 "its sum and clipped to [1e-15, 1 - 1e-15]"),
    "auc": ("ROC AUC", "the area under the ROC curve of your score for the positive class `1`"),
    "rmse": ("RMSE", "root mean squared error"),
    "mae": ("MAE", "mean absolute error"),
    "rmsle": ("RMSLE", "root mean squared logarithmic error, sqrt(mean((log(1 + p) - "
              "log(1 + y))^2)); predictions must be > -1"),
}


def _column_type(c: Column) -> str:
    kind = {"num": "numeric", "int": "integer", "cat": "categorical", "text": "text"}[c.ftype]
    if c.ftype == "cat":
        kind += ": " + ", ".join(f"`{l}`" for l in c.levels)
    if c.ftype == "text":
        kind += ": space-separated tokens"
    return kind + (", has missing values" if c.missing > 0 else "")


def _describe_column(c: Column) -> str:
    return f"`{c.name}` ({_column_type(c)})"


def describe(spec: InstanceSpec, n_train: int, n_test: int,
             target_cols: tuple[str, ...]) -> str:
    """The task page (markdown): files, columns, target, metric and direction, format."""
    name, what = _METRIC_TEXT[spec.metric]
    direction = "lower is better" if spec.metric_info.lower_is_better else "higher is better"
    kind = spec.metric_info.kind
    tgt, idc = f"`{spec.target}`", f"`{spec.id_column}`"
    if spec.target_type == "regression":
        goal = f"predict {tgt}, a numeric quantity"
    elif spec.target_type == "binary":
        goal = (f"predict {tgt}, a binary outcome (" + " / ".join(f"`{l}`" for l in spec.labels)
                + ")")
    else:
        goal = (f"predict {tgt}, one of {len(spec.labels)} classes ("
                + ", ".join(f"`{l}`" for l in spec.labels) + ")")
    if kind == "label":
        fmt = f"{tgt} holds the predicted label."
    elif kind == "probability":
        fmt = ("one column per class (" + ", ".join(f"`{c}`" for c in target_cols)
               + ") holding its predicted probability.")
    elif kind == "score":
        fmt = (f"{tgt} holds a score for the positive class `1` (a probability or any real; "
               "higher = more likely).")
    else:
        fmt = f"{tgt} holds the predicted value."
    header = ",".join([spec.id_column, *target_cols])
    cols = "\n".join(f"- {_describe_column(c)}" for c in spec.columns)
    missing = ("Some columns have missing values (empty cells).\n\n" if spec.has_missing else "")
    files = [
        f"`train.csv` ({n_train} rows): {idc}, the features and the target {tgt}",
        f"`test.csv` ({n_test} rows): {idc} and the features, without the target",
        "`sample_submission.csv`: a valid submission with a trivial prediction",
    ]
    synth = "The data is synthetic (procedurally generated)."
    if spec.wording == 0:
        return (
            f"# {spec.title.capitalize()}\n\n## Overview\n\nEach row describes one {spec.entity}. "
            f"Your goal: {goal}. {synth}\n\n## Data\n\n" + "\n".join(f"- {f}." for f in files)
            + f"\n\nFeature columns:\n\n{cols}\n\n{missing}Ids are random; row order carries no "
            f"information.\n\n## Evaluation\n\nThe metric is **{name}** ({what}); {direction}. "
            f"Half of the test rows are scored after every run, the other half only in the final "
            f"evaluation.\n\n## Submission File\n\nWrite `./submission/submission.csv` with a "
            f"header "
            f"and one row per test {idc}: {fmt}\n\n```\n{header}\n...\n```\n")
    if spec.wording == 1:
        return (
            f"# Task: {spec.title}\n\n{synth} The rows are {spec.entity} records; {goal}.\n\n"
            f"### Files (in `./input`)\n\n" + "\n".join(f"* {f}" for f in files)
            + f"\n\n### Columns\n\nThe id column is {idc}. Features:\n\n"
            + cols.replace("- ", "* ") + f"\n\n{missing}### Scoring\n\nSubmissions are ranked by "
            f"{name} ({direction}): {what}. The hidden test rows are split in two halves: one "
            f"scored after each run, one kept for the final score.\n\n### What to submit\n\n"
            f"`./submission/submission.csv`, every test {idc} exactly once; {fmt}\n\n"
            f"```\n{header}\n```\n")
    return (
        f"# {spec.title.title()}: {spec.target}\n\n## Problem\n\nA synthetic table of "
        f"{spec.entity}s. Using the labelled rows of `train.csv`, {goal} for every row of "
        f"`test.csv`.\n\n## Evaluation metric\n\n{name}, {direction} ({what}). One half of the "
        f"test set gives the score you see after a run; the other half is held out.\n\n"
        f"## Data description\n\n" + "\n".join(f"{i}. {f}" for i, f in enumerate(files, 1))
        + "\n\n| column | type |\n|---|---|\n"
        + "\n".join(f"| `{c.name}` | {_column_type(c)} |" for c in spec.columns)
        + f"\n\n{missing}## Submission format\n\nA CSV at `./submission/submission.csv` with the "
        f"columns {', '.join(f'`{c}`' for c in (spec.id_column, *target_cols))}, one row per "
        f"test id: {fmt}\n\n```\n{header}\n...\n```\n")


# ------------------------------------------------------------------------------------------------
# The builder
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ProceduralTaskBuilder:
    """The registry's builder of one instance (``task_id``, ``prepare``, ``hidden_paths``,
    ``reference_leaderboard``, ``family``)."""

    kind: str
    index: int
    family: str = FAMILY

    @property
    def task_id(self) -> str:
        return make_task_id(self.kind, self.index)

    @property
    def spec(self) -> InstanceSpec:
        return make_spec(self.kind, self.index)

    @property
    def metric(self) -> str:
        return self.spec.metric

    @property
    def split(self) -> str:
        return instance_split(self.task_id)

    def hidden_paths(self) -> tuple[str, ...]:
        """The generator's source (it could regenerate the answers)."""
        return (str(pathlib.Path(__file__).resolve()),)

    def reference_leaderboard(self, seed: int = 0) -> tuple[list[float], str]:
        return reference_leaderboard(self.task_id, seed)

    def prepare(self, out_dir: "os.PathLike | str", seed: int = 0) -> base.Task:
        return prepare_instance(self.spec, pathlib.Path(out_dir), seed)


def prepare_instance(spec: InstanceSpec, out_dir: pathlib.Path, seed: int) -> base.Task:
    """Writes one instance in MLE-bench's layout (as ``offline_suite.prepare_table``); returns
    the Task. Same (instance, seed) -> byte-identical files."""
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    feats, target = generate_table(spec)
    n = len(feats)
    target_cols, labels, to_answers = _submission_layout(spec, target)
    kind = spec.metric_info.kind
    strata = target.iloc[:, 0].astype(str).to_numpy() if spec.target_type != "regression" else None
    rng = np.random.default_rng([_KIND_CODE[spec.kind], spec.index, 3, int(seed)])
    idx = np.arange(n)
    train_idx, test_idx = _split(rng, idx, spec.train_fraction, strata)
    dev_idx, _ = _split(rng, test_idx, 0.5, strata)
    ids = _make_ids(spec, rng, n)
    train_idx, test_idx = rng.permutation(train_idx), rng.permutation(test_idx)

    out_dir = pathlib.Path(out_dir)
    pub, priv = out_dir / "public", out_dir / "private"
    pub.mkdir(parents=True, exist_ok=True)
    priv.mkdir(parents=True, exist_ok=True)
    idc = spec.id_column
    train = pd.concat([pd.DataFrame({idc: ids[train_idx]}),
                       feats.iloc[train_idx].reset_index(drop=True),
                       target.iloc[train_idx].reset_index(drop=True)], axis=1)
    test = pd.concat([pd.DataFrame({idc: ids[test_idx]}),
                      feats.iloc[test_idx].reset_index(drop=True)], axis=1)
    _to_csv(train, pub / "train.csv")
    _to_csv(test, pub / "test.csv")
    answers_all = to_answers(target)
    answers_all.insert(0, idc, ids)
    dev_set = set(dev_idx.tolist())
    for name, part in (("dev", [i for i in test_idx if i in dev_set]),
                       ("test", [i for i in test_idx if i not in dev_set])):
        _to_csv(answers_all.iloc[part].reset_index(drop=True), priv / base.ANSWER_FILES[name])
    sample = _trivial_prediction(spec, to_answers(target.iloc[train_idx]), len(test_idx),
                                 target_cols)
    sample.insert(0, idc, ids[test_idx])
    _to_csv(sample, pub / "sample_submission.csv")
    description = describe(spec, len(train_idx), len(test_idx), target_cols)
    (pub / "description.md").write_text(description)

    task = base.Task(
        task_id=spec.task_id, description=description, public_dir=pub.resolve(),
        private_dir=priv.resolve(), metric=spec.metric,
        lower_is_better=spec.metric_info.lower_is_better, id_column=idc,
        target_columns=target_cols, labels=labels if kind == "label" else None,
        time_limit_s=TIME_LIMIT_S, memory_limit_mb=MEMORY_LIMIT_MB,
        hidden_paths=ProceduralTaskBuilder(spec.kind, spec.index).hidden_paths(), seed=int(seed),
        source=f"SYNTHETIC: procedural generator {spec.kind!r}, instance {spec.index} "
               f"(sandbox/tasks/procedural.py), split {instance_split(spec.task_id)}")
    task.baseline_score = task.grade(pub / "sample_submission.csv", "dev")
    base.write_task_json(task, out_dir)
    return task


# ------------------------------------------------------------------------------------------------
# Reference leaderboards (the compact sweep file)
# ------------------------------------------------------------------------------------------------

RESULT_COLUMNS = ("task_id", "team", "status", "score", "dev_score", "wall_s", "digest")


@functools.lru_cache(maxsize=8)
def _results(seed: int) -> Optional[pd.DataFrame]:
    path = pathlib.Path(str(RESULTS_FILE).format(seed=seed))
    if not path.exists():
        return None
    return pd.read_csv(path, dtype={"task_id": str, "team": str, "status": str, "digest": str})


def sweep_results(seed: int = 0) -> Optional[pd.DataFrame]:
    """The committed sweep of ``seed`` (one row per instance and baseline script; columns
    ``RESULT_COLUMNS``), or None when there is none."""
    df = _results(seed)
    return None if df is None else df.copy()


def reference_leaderboard(task_id: str, seed: int = 0) -> tuple[list[float], str]:
    """(final-test scores of the valid baseline runs, source note) from the compact sweep file,
    or ([], "") without one."""
    df = _results(seed)
    if df is None:
        return [], ""
    rows = df[(df["task_id"] == task_id) & (df["status"] == "ok")]
    scores = [float(s) for s in rows["score"].dropna()]
    if not scores:
        return [], ""
    return scores, (f"our own baseline sweep (python -m sandbox.procedural_sweep, seed {seed}, "
                    "final-test scores); not human teams")


def prepared_digest(task_dir: "os.PathLike | str") -> str:
    """sha256 over the sorted (path, sha256) pairs of a prepared task's files (checksums.json
    excluded): one string that names the exact files a leaderboard was measured on."""
    from sandbox.prepare import file_checksums

    sums = file_checksums(pathlib.Path(task_dir))
    return hashlib.sha256("\n".join(f"{k} {v}" for k, v in sums.items()).encode()).hexdigest()


# ------------------------------------------------------------------------------------------------
# Registration
# ------------------------------------------------------------------------------------------------

BUILDERS: tuple[ProceduralTaskBuilder, ...] = tuple(
    ProceduralTaskBuilder(k, i) for k in KINDS for i in range(INSTANCES_PER_KIND))

for _b in BUILDERS:
    registry.register(_b)
