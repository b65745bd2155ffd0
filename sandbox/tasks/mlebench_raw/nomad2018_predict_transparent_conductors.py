"""nomad2018-predict-transparent-conductors: Kaggle's download holds ``train.csv.zip``
(``train.csv``: id (from 1), spacegroup, number_of_total_atoms, percent_atom_al/ga/in,
lattice_vector_1..3_ang, lattice_angle_alpha/beta/gamma_degree, formation_energy_ev_natom,
bandgap_energy_ev; 2400 (Al_x Ga_y In_z)2 O3 crystals), ``test.csv.zip`` (``test.csv``: 600
crystals, ids from 1, no targets), ``train.zip`` and ``test.zip`` (``train/<id>/geometry.xyz``,
``test/<id>/geometry.xyz``: ASE's text format, three ``#`` header lines, three ``lattice_vector x y
z`` lines, then one ``atom x y z El`` line per atom in Cartesian angstroms) and
``sample_submission.csv.zip`` (id, formation_energy_ev_natom = 0.1779, bandgap_energy_ev = 1.8892).
MLE-bench's preparer extracts the four data zips, splits ``train.csv`` and copies the matching
``train/<id>/geometry.xyz``. Here the crystals are made up (a quarter as many test as training
crystals): one of Kaggle's six spacegroups, 10 to 80 atoms (two fifths cations, the rest oxygen),
cation fractions in multiples of one cation, a cell whose size grows with the atom count and the
indium share (Vegard-like), random atom positions inside it. The bandgap falls from about 5.5 eV
(all Al) to about 1 eV (all In); the formation energy is a mixing energy of the cations plus a
spacegroup offset; both carry noise.
"""
from __future__ import annotations

import pathlib
import zipfile

import numpy as np
import pandas as pd

from sandbox.tasks.mlebench_raw._zip import zip_csv, zip_entry

#: spacegroup -> (atom counts, cell lengths (angstrom) of a 40-atom cell, angles alpha/beta/gamma)
_SPACEGROUPS = {
    12: ((20, 40, 80), (24.0, 6.2, 6.1), (90.0, 103.8, 90.0)),
    33: ((40, 80), (10.2, 8.8, 9.5), (90.0, 90.0, 90.0)),
    167: ((10, 30), (10.0, 10.0, 6.0), (90.0, 90.0, 120.0)),
    194: ((10, 30, 80), (6.1, 6.1, 23.5), (90.0, 90.0, 120.0)),
    206: ((40, 80), (9.3, 9.3, 9.3), (90.0, 90.0, 90.0)),
    227: ((10, 40), (10.4, 6.0, 14.6), (90.0, 90.0, 90.0)),
}
_SG_FORMATION = {12: 0.02, 33: 0.05, 167: 0.0, 194: 0.08, 206: 0.03, 227: 0.12}
_SG_GAP = {12: 0.1, 33: 0.0, 167: 0.3, 194: -0.2, 206: 0.2, 227: -0.4}
_COLUMNS = ["id", "spacegroup", "number_of_total_atoms", "percent_atom_al", "percent_atom_ga",
            "percent_atom_in", "lattice_vector_1_ang", "lattice_vector_2_ang",
            "lattice_vector_3_ang", "lattice_angle_alpha_degree", "lattice_angle_beta_degree",
            "lattice_angle_gamma_degree", "formation_energy_ev_natom", "bandgap_energy_ev"]
_HEADER = ("#=======================================================\n"
           "#Created using the Atomic Simulation Environment (ASE)\n"
           "#=======================================================\n")


def _cell(a: float, b: float, c: float, alpha: float, beta: float, gamma: float) -> np.ndarray:
    """Lattice vectors (rows) of a cell with these lengths and angles (degrees)."""
    al, be, ga = np.radians([alpha, beta, gamma])
    v1 = [a, 0.0, 0.0]
    v2 = [b * np.cos(ga), b * np.sin(ga), 0.0]
    cx = c * np.cos(be)
    cy = c * (np.cos(al) - np.cos(be) * np.cos(ga)) / np.sin(ga)
    return np.array([v1, v2, [cx, cy, np.sqrt(max(c * c - cx * cx - cy * cy, 1e-9))]])


def _crystal(rng: np.random.Generator) -> tuple[dict, str]:
    """One made-up crystal: its csv row (no id) and its geometry.xyz text."""
    sg = int(rng.choice(list(_SPACEGROUPS)))
    counts, lengths, angles = _SPACEGROUPS[sg]
    n = int(rng.choice(counts))
    n_cat = 2 * n // 5
    share = rng.dirichlet(rng.choice([0.5, 2.0], size=3))  # Al, Ga, In
    cat = rng.multinomial(n_cat, share)
    x_al, x_ga, x_in = cat / n_cat
    scale = (n / 40) ** (1 / 3) * (1 + 0.07 * x_in - 0.05 * x_al)
    abc = np.array(lengths) * scale * rng.normal(1, 0.01, 3)
    ang = np.array(angles) + rng.normal(0, 0.02, 3)
    gap = 1.0 + 4.5 * x_al + 2.4 * x_ga - 0.4 * x_al * x_in + _SG_GAP[sg] + rng.normal(0, 0.15)
    form = (0.05 + 0.5 * x_al * x_in + 0.25 * x_ga * x_in + 0.1 * x_al * x_ga
            + _SG_FORMATION[sg] + rng.normal(0, 0.015))
    row = {"spacegroup": sg, "number_of_total_atoms": float(n),
           "percent_atom_al": round(x_al, 4), "percent_atom_ga": round(x_ga, 4),
           "percent_atom_in": round(x_in, 4),
           **{f"lattice_vector_{k + 1}_ang": round(v, 4) for k, v in enumerate(abc)},
           "lattice_angle_alpha_degree": round(ang[0], 4),
           "lattice_angle_beta_degree": round(ang[1], 4),
           "lattice_angle_gamma_degree": round(ang[2], 4),
           "formation_energy_ev_natom": round(max(form, 0.0), 4),
           "bandgap_energy_ev": round(max(gap, 0.05), 4)}
    vectors = _cell(*abc, *ang)
    symbols = ["Al"] * cat[0] + ["Ga"] * cat[1] + ["In"] * cat[2] + ["O"] * (n - n_cat)
    xyz = rng.random((n, 3)) @ vectors
    lines = [_HEADER]
    lines += ["lattice_vector " + " ".join(f"{v:.16f}" for v in vec) + " \n" for vec in vectors]
    lines += [f"atom {p[0]:.16f} {p[1]:.16f} {p[2]:.16f} {s}\n" for p, s in zip(xyz, symbols)]
    return row, "".join(lines)


def _write(raw: pathlib.Path, split: str, n: int, rng: np.random.Generator) -> pd.DataFrame:
    rows = []
    with zipfile.ZipFile(raw / f"{split}.zip", "w", zipfile.ZIP_DEFLATED) as z:
        for i in range(1, n + 1):
            row, geometry = _crystal(rng)
            rows.append({"id": i, **row})
            z.writestr(zip_entry(f"{split}/{i}/geometry.xyz"), geometry)
    df = pd.DataFrame(rows)[_COLUMNS]
    if split == "test":
        df = df.drop(columns=["formation_energy_ev_natom", "bandgap_energy_ev"])
    zip_csv(raw / f"{split}.csv.zip", f"{split}.csv", df)
    return df


def write_raw(raw: pathlib.Path, n_rows: int, rng: np.random.Generator) -> None:
    _write(raw, "train", n_rows, rng)
    test = _write(raw, "test", max(n_rows // 4, 1), rng)  # Kaggle: 2400 train, 600 test
    zip_csv(raw / "sample_submission.csv.zip", "sample_submission.csv",
             pd.DataFrame({"id": test["id"], "formation_energy_ev_natom": 0.1779,
                           "bandgap_energy_ev": 1.8892}))
