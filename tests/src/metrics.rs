//! Reading figures back out of a component's Prometheus registry: counters, gauges and
//! histogram quantiles, for tests and reports.

use prometheus::proto::{MetricFamily, MetricType};

/// A histogram read from a registry, summed over every label set.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Histogram {
    pub count: u64,
    /// Sum of the observations (for a wait-time histogram: total seconds waited).
    pub sum: f64,
    /// Cumulative (upper bound, count) pairs.
    pub buckets: Vec<(f64, u64)>,
}

impl Histogram {
    /// The upper bound of the bucket holding quantile `q` (0..=1): a conservative estimate.
    pub fn quantile(&self, q: f64) -> f64 {
        if self.count == 0 {
            return 0.0;
        }
        let rank = (q * self.count as f64).ceil().max(1.0) as u64;
        for (le, c) in &self.buckets {
            if *c >= rank {
                return *le;
            }
        }
        f64::INFINITY
    }
}

fn family<'a>(families: &'a [MetricFamily], name: &str) -> Option<&'a MetricFamily> {
    families.iter().find(|f| f.name() == name)
}

fn labels_match(m: &prometheus::proto::Metric, labels: &[(&str, &str)]) -> bool {
    labels.iter().all(|(k, v)| {
        m.get_label()
            .iter()
            .any(|l| l.name() == *k && l.value() == *v)
    })
}

/// Sum of a counter or gauge over the label sets that carry `labels`.
pub fn value(registry: &prometheus::Registry, name: &str, labels: &[(&str, &str)]) -> f64 {
    let families = registry.gather();
    let Some(f) = family(&families, name) else {
        return 0.0;
    };
    f.get_metric()
        .iter()
        .filter(|m| labels_match(m, labels))
        .map(|m| match f.get_field_type() {
            MetricType::COUNTER => m.get_counter().get_value(),
            MetricType::GAUGE => m.get_gauge().get_value(),
            _ => 0.0,
        })
        .sum()
}

/// A histogram summed over its label sets.
pub fn histogram(registry: &prometheus::Registry, name: &str) -> Histogram {
    let families = registry.gather();
    let mut out = Histogram::default();
    let Some(f) = family(&families, name) else {
        return out;
    };
    for m in f.get_metric() {
        let h = m.get_histogram();
        out.count += h.get_sample_count();
        out.sum += h.get_sample_sum();
        for (i, b) in h.get_bucket().iter().enumerate() {
            if out.buckets.len() <= i {
                out.buckets.push((b.upper_bound(), 0));
            }
            out.buckets[i].1 += b.cumulative_count();
        }
    }
    out
}
