//! Bounded metric labels: every request counts under its tenant and model,
//! but a gateway defines at most `max_tenants` × `max_models` series; values
//! past the bound count under `other`, so a flood of made-up model names
//! cannot exhaust the host's stats memory.

use std::collections::HashMap;

use serde::Deserialize;

use crate::config::ConfigError;

/// The label value that collects everything past a bound.
pub const OVERFLOW: &str = "other";
/// The label value of an absent tenant or model.
pub const UNKNOWN: &str = "unknown";
/// Longest label value kept, bytes.
pub const MAX_LABEL: usize = 64;

/// How many distinct label values a gateway keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(deny_unknown_fields)]
pub struct LabelLimits {
    /// Distinct tenants (the rest count as `other`; 1–10000).
    #[serde(default = "default_tenants")]
    pub max_tenants: u32,
    /// Distinct models (the rest count as `other`; 1–10000).
    #[serde(default = "default_models")]
    pub max_models: u32,
}

fn default_tenants() -> u32 {
    100
}
fn default_models() -> u32 {
    20
}

impl Default for LabelLimits {
    fn default() -> Self {
        LabelLimits {
            max_tenants: default_tenants(),
            max_models: default_models(),
        }
    }
}

impl LabelLimits {
    /// Checks the bounds; `at` is the field path.
    pub fn check(&self, at: &str) -> Result<(), ConfigError> {
        for (name, value) in [
            ("max_tenants", self.max_tenants),
            ("max_models", self.max_models),
        ] {
            if !(1..=10_000).contains(&value) {
                return Err(ConfigError::new(
                    format!("{at}.{name}"),
                    format!("{value} must be between 1 and 10000"),
                ));
            }
        }
        Ok(())
    }
}

/// A label value as the stats system can carry it: ASCII letters, digits
/// and `-` (anything else becomes `-`, since `_` and `.` separate name parts
/// in Envoy's stat names), at most [`MAX_LABEL`] bytes; empty is `unknown`.
pub fn label_value(raw: &str) -> String {
    let value: String = raw
        .bytes()
        .take(MAX_LABEL)
        .map(|b| {
            if b.is_ascii_alphanumeric() || b == b'-' {
                b as char
            } else {
                '-'
            }
        })
        .collect();
    if value.is_empty() {
        UNKNOWN.into()
    } else {
        value
    }
}

/// One (tenant, model) series.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Series {
    /// Its index, dense from 0 in order of first use.
    pub index: usize,
    /// Whether this call created it (the caller defines its metrics).
    pub new: bool,
}

/// The series seen so far, within the limits.
#[derive(Debug, Default)]
pub struct SeriesTable {
    limits: LabelLimits,
    /// Raw value → value id, for the values admitted so far.
    tenants: HashMap<String, u32>,
    models: HashMap<String, u32>,
    /// Labels by value id.
    tenant_labels: Vec<String>,
    model_labels: Vec<String>,
    series: HashMap<(u32, u32), usize>,
    labels: Vec<(u32, u32)>,
}

/// The value id of `other`.
const OVERFLOW_ID: u32 = u32::MAX;

impl SeriesTable {
    /// An empty table.
    pub fn new(limits: LabelLimits) -> SeriesTable {
        SeriesTable {
            limits,
            ..SeriesTable::default()
        }
    }

    /// The series of a request by `tenant` for `model` (raw values). Known
    /// values and pairs are found without allocating.
    pub fn series(&mut self, tenant: &str, model: &str) -> Series {
        let tenant = admit(
            &mut self.tenants,
            &mut self.tenant_labels,
            self.limits.max_tenants,
            tenant,
        );
        let model = admit(
            &mut self.models,
            &mut self.model_labels,
            self.limits.max_models,
            model,
        );
        if let Some(&index) = self.series.get(&(tenant, model)) {
            return Series { index, new: false };
        }
        let index = self.labels.len();
        self.labels.push((tenant, model));
        self.series.insert((tenant, model), index);
        Series { index, new: true }
    }

    /// The (tenant, model) labels of a series.
    pub fn labels(&self, index: usize) -> Option<(&str, &str)> {
        let &(tenant, model) = self.labels.get(index)?;
        Some((
            label_of(&self.tenant_labels, tenant),
            label_of(&self.model_labels, model),
        ))
    }

    /// Number of series.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Whether no request was counted yet.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }
}

/// The value id for `raw`: its own while the bound allows, else `other`.
fn admit(known: &mut HashMap<String, u32>, labels: &mut Vec<String>, max: u32, raw: &str) -> u32 {
    if let Some(&id) = known.get(raw) {
        return id;
    }
    if known.len() >= max as usize {
        return OVERFLOW_ID;
    }
    let id = labels.len() as u32;
    labels.push(label_value(raw));
    known.insert(raw.to_string(), id);
    id
}

fn label_of(labels: &[String], id: u32) -> &str {
    labels.get(id as usize).map_or(OVERFLOW, String::as_str)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_safe_for_stat_names() {
        assert_eq!(label_value("acme"), "acme");
        assert_eq!(label_value("claude-3.5_sonnet"), "claude-3-5-sonnet");
        assert_eq!(label_value(""), "unknown");
        assert_eq!(label_value("é"), "--");
        assert_eq!(label_value(&"x".repeat(100)).len(), MAX_LABEL);
    }

    #[test]
    fn series_are_bounded_with_an_overflow_bucket() {
        let mut table = SeriesTable::new(LabelLimits {
            max_tenants: 2,
            max_models: 1,
        });
        assert_eq!(
            table.series("a", "m1"),
            Series {
                index: 0,
                new: true
            }
        );
        assert_eq!(
            table.series("a", "m1"),
            Series {
                index: 0,
                new: false
            }
        );
        assert_eq!(table.series("b", "m1").index, 1);
        // Third tenant and second model overflow.
        let c = table.series("c", "m2");
        assert_eq!(table.labels(c.index), Some(("other", "other")));
        let d = table.series("d", "m3");
        assert_eq!(
            d,
            Series {
                index: c.index,
                new: false
            }
        );
        let a9 = table.series("a", "m9").index;
        assert_eq!(table.labels(a9), Some(("a", "other")));
        for i in 0..10_000 {
            table.series(&format!("t{i}"), &format!("m{i}"));
        }
        assert!(table.len() <= 2 * 2 + 2, "{} series", table.len());
    }
}
