"""The schema of a procedural instance: its id, the themes it draws names from, ``make_spec``.

An instance is a (generator kind, index) pair, ``proc-<kind>-<index:03d>`` (``make_task_id``,
``parse_task_id``); its ``InstanceSpec`` (theme, column names and their case style, column
types, id column name and id style, target name and type, labels, metric, row count, missing
values, noise, the description's wording) is a pure function of that pair: ``make_spec`` draws it
from a numpy ``Generator`` seeded with ``[KIND_CODE[kind], index, 1]`` (``instance_rng``).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import numpy as np

from sandbox import grading

PREFIX = "proc"
KINDS = ("linear", "rules", "clusters", "counts", "tokens")
KIND_CODE = {"linear": 11, "rules": 12, "clusters": 13, "counts": 14, "tokens": 15}


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


# ------------------------------------------------------------------------------------------------
# The instance spec (schema)
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


def instance_rng(kind: str, index: int, stream: int) -> np.random.Generator:
    """The instance's numpy Generator of ``stream`` (1: the schema, 2: the data)."""
    return np.random.default_rng([KIND_CODE[kind], int(index), stream])


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
    rng = instance_rng(kind, index, 1)
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
