//! Metrics modules define: counters, gauges, histograms, process-wide by
//! name, readable by tests and exported as Prometheus text the way Envoy
//! prints them with the `_key=value` → label `stats_tags` the project ships.

use std::collections::BTreeMap;
use std::fmt::Write;

use crate::abi::MetricType;

/// Envoy's default histogram bucket bounds.
const BUCKETS: [f64; 19] = [
    0.5, 1.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0, 10000.0, 30000.0,
    60000.0, 300000.0, 600000.0, 1800000.0, 3600000.0,
];

/// One metric.
#[derive(Debug, Clone)]
struct Metric {
    name: String,
    kind: MetricType,
    value: u64,
    samples: Vec<u64>,
}

/// All metrics of a host.
#[derive(Debug, Default)]
pub struct Metrics {
    list: Vec<Metric>,
}

impl Metrics {
    /// Defines `name` (or returns the existing id: every VM shares it).
    pub(crate) fn define(&mut self, kind: MetricType, name: &str) -> u32 {
        if let Some(i) = self
            .list
            .iter()
            .position(|m| m.name == name && m.kind == kind)
        {
            return i as u32;
        }
        self.list.push(Metric {
            name: name.to_string(),
            kind,
            value: 0,
            samples: vec![],
        });
        (self.list.len() - 1) as u32
    }

    pub(crate) fn increment(&mut self, id: u32, offset: i64) -> bool {
        let Some(m) = self.list.get_mut(id as usize) else {
            return false;
        };
        if m.kind == MetricType::Histogram {
            return false;
        }
        m.value = if offset >= 0 {
            m.value.saturating_add(offset as u64)
        } else {
            m.value.saturating_sub(offset.unsigned_abs())
        };
        true
    }

    pub(crate) fn record(&mut self, id: u32, value: u64) -> bool {
        let Some(m) = self.list.get_mut(id as usize) else {
            return false;
        };
        match m.kind {
            MetricType::Histogram => m.samples.push(value),
            _ => m.value = value,
        }
        true
    }

    pub(crate) fn get(&self, id: u32) -> Option<u64> {
        self.list.get(id as usize).map(|m| match m.kind {
            MetricType::Histogram => m.samples.len() as u64,
            _ => m.value,
        })
    }

    /// The value of counter or gauge `name` (as the module named it).
    pub fn value(&self, name: &str) -> Option<u64> {
        self.list
            .iter()
            .find(|m| m.name == name && m.kind != MetricType::Histogram)
            .map(|m| m.value)
    }

    /// The samples recorded into histogram `name`.
    pub fn samples(&self, name: &str) -> Option<&[u64]> {
        self.list
            .iter()
            .find(|m| m.name == name && m.kind == MetricType::Histogram)
            .map(|m| m.samples.as_slice())
    }

    /// Prometheus text format, labels extracted from `_key=value` suffixes.
    pub fn prometheus(&self) -> String {
        type Family<'a> = (MetricType, Vec<(String, &'a Metric)>);
        let mut families: BTreeMap<String, Family<'_>> = BTreeMap::new();
        for m in &self.list {
            let (family, labels) = split_labels(&m.name);
            families
                .entry(sanitize(&family))
                .or_insert_with(|| (m.kind, vec![]))
                .1
                .push((labels, m));
        }
        let mut out = String::new();
        for (family, (kind, members)) in families {
            let kind_name = match kind {
                MetricType::Counter => "counter",
                MetricType::Gauge => "gauge",
                MetricType::Histogram => "histogram",
            };
            let _ = writeln!(out, "# TYPE {family} {kind_name}");
            for (labels, m) in members {
                if kind == MetricType::Histogram {
                    let mut cumulative = 0;
                    for bound in BUCKETS {
                        cumulative = m.samples.iter().filter(|s| (**s as f64) <= bound).count();
                        let _ = writeln!(
                            out,
                            "{family}_bucket{{{}}} {cumulative}",
                            join(&labels, &format!("le=\"{bound}\""))
                        );
                    }
                    let _ = cumulative;
                    let _ = writeln!(
                        out,
                        "{family}_bucket{{{}}} {}",
                        join(&labels, "le=\"+Inf\""),
                        m.samples.len()
                    );
                    let sum: u64 = m.samples.iter().sum();
                    let _ = writeln!(out, "{family}_sum{{{labels}}} {sum}");
                    let _ = writeln!(out, "{family}_count{{{labels}}} {}", m.samples.len());
                } else {
                    let _ = writeln!(out, "{family}{{{labels}}} {}", m.value);
                }
            }
        }
        out
    }
}

fn join(labels: &str, extra: &str) -> String {
    if labels.is_empty() {
        extra.to_string()
    } else {
        format!("{labels},{extra}")
    }
}

/// `name_rule=x_observer=y` → (`name`, `rule="x",observer="y"`).
fn split_labels(name: &str) -> (String, String) {
    let mut family = name.to_string();
    let mut labels = vec![];
    while let Some(eq) = family.rfind('=') {
        let value = family[eq + 1..].to_string();
        let Some(us) = family[..eq].rfind('_') else {
            break;
        };
        let key = family[us + 1..eq].to_string();
        if key.is_empty() || value.is_empty() {
            break;
        }
        labels.push(format!("{key}=\"{value}\""));
        family.truncate(us);
    }
    labels.reverse();
    (family, labels.join(","))
}

fn sanitize(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == ':' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prometheus_labels_like_envoy_with_stats_tags() {
        let mut m = Metrics::default();
        let a = m.define(
            MetricType::Counter,
            "zerolayer_activation_rule_matches_rule=premium",
        );
        let b = m.define(MetricType::Counter, "zerolayer_activation_requests");
        assert_eq!(
            m.define(MetricType::Counter, "zerolayer_activation_requests"),
            b
        );
        m.increment(a, 3);
        m.increment(b, 5);
        let text = m.prometheus();
        assert!(
            text.contains("zerolayer_activation_rule_matches{rule=\"premium\"} 3"),
            "{text}"
        );
        assert!(text.contains("zerolayer_activation_requests{} 5"), "{text}");
        assert_eq!(m.value("zerolayer_activation_requests"), Some(5));
    }

    #[test]
    fn histograms() {
        let mut m = Metrics::default();
        let h = m.define(MetricType::Histogram, "latency_ms");
        m.record(h, 3);
        m.record(h, 700);
        assert_eq!(m.samples("latency_ms"), Some(&[3, 700][..]));
        let text = m.prometheus();
        assert!(text.contains("latency_ms_bucket{le=\"5\"} 1"), "{text}");
        assert!(text.contains("latency_ms_count{} 2"), "{text}");
    }
}
