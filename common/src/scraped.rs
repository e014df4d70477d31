//! Samples a Prometheus collector builds when `/metrics` is scraped, from state its
//! component holds anyway (the agent's per-server coverage rows, the dispatcher's routing
//! table): one way to write a labelled gauge or counter and a family from its `Desc`, so
//! such collectors write only which series exist and their values.

use prometheus::core::Desc;
use prometheus::proto::{Counter, Gauge, LabelPair, Metric, MetricFamily, MetricType};

fn labelled(labels: &[(&str, &str)]) -> Metric {
    Metric::from_label(
        labels
            .iter()
            .map(|(name, value)| {
                let mut l = LabelPair::default();
                l.set_name((*name).to_owned());
                l.set_value((*value).to_owned());
                l
            })
            .collect(),
    )
}

/// One gauge sample; `labels` in name order, as the text format writes them.
pub fn gauge(labels: &[(&str, &str)], value: f64) -> Metric {
    let mut g = Gauge::default();
    g.set_value(value);
    let mut m = labelled(labels);
    m.set_gauge(g);
    m
}

/// One counter sample; `labels` in name order.
pub fn counter(labels: &[(&str, &str)], value: u64) -> Metric {
    let mut c = Counter::default();
    c.set_value(value as f64);
    let mut m = labelled(labels);
    m.set_counter(c);
    m
}

/// The family `desc` describes, of `kind`, with `metrics` (an empty one is left out of
/// the page by the registry).
pub fn family(desc: &Desc, kind: MetricType, metrics: Vec<Metric>) -> MetricFamily {
    let mut f = MetricFamily::default();
    f.set_name(desc.fq_name.clone());
    f.set_help(desc.help.clone());
    f.set_field_type(kind);
    f.set_metric(metrics);
    f
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus::core::Collector;
    use std::collections::HashMap;

    struct Two(Desc, Desc);

    impl Collector for Two {
        fn desc(&self) -> Vec<&Desc> {
            vec![&self.0, &self.1]
        }
        fn collect(&self) -> Vec<MetricFamily> {
            vec![
                family(
                    &self.0,
                    MetricType::GAUGE,
                    vec![gauge(&[("server_id", "a"), ("state", "idle")], 2.5)],
                ),
                family(
                    &self.1,
                    MetricType::COUNTER,
                    vec![counter(&[("tunnel_id", "t")], 7)],
                ),
            ]
        }
    }

    #[test]
    fn the_samples_scrape_as_the_text_format_writes_labelled_series() {
        let desc = |name: &str, labels: &[&str]| {
            Desc::new(
                name.into(),
                format!("{name} help"),
                labels.iter().map(|l| l.to_string()).collect(),
                HashMap::new(),
            )
            .unwrap()
        };
        let registry = prometheus::Registry::new();
        registry
            .register(Box::new(Two(
                desc("x_streams", &["server_id", "state"]),
                desc("x_spills_total", &["tunnel_id"]),
            )))
            .unwrap();
        let page = crate::admin::render_metrics(&registry);
        assert_eq!(
            page,
            "# HELP x_spills_total x_spills_total help\n\
             # TYPE x_spills_total counter\n\
             x_spills_total{tunnel_id=\"t\"} 7\n\
             # HELP x_streams x_streams help\n\
             # TYPE x_streams gauge\n\
             x_streams{server_id=\"a\",state=\"idle\"} 2.5\n"
        );
    }
}
