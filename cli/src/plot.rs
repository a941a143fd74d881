//! SVG plots of a simulation: GPU memory over time without a plan (every tensor resident),
//! with the plan (simulated), and the capacity line; and bandwidth use per resource, with the
//! bytes written to the SSDs per iteration and the drives' projected life.

use std::path::Path;

use plotters::prelude::*;
use teraio_scheduler::{Hardware, Resource, SimReport, Trace};

use crate::{CliError, Result};

const MAX_POINTS: usize = 4000;

fn plot_err<E: std::fmt::Display>(e: E) -> CliError {
    CliError::Usage(format!("plot: {e}"))
}

/// Step curve from (time, value) samples, reduced to at most `MAX_POINTS` buckets keeping
/// each bucket's maximum (memory peaks stay visible).
fn step_max(samples: &[(f64, f64)], t_end: f64) -> Vec<(f64, f64)> {
    if samples.is_empty() || t_end <= 0.0 {
        return Vec::new();
    }
    let buckets = MAX_POINTS / 2;
    let width = t_end / buckets as f64;
    let mut out = Vec::with_capacity(MAX_POINTS);
    let mut i = 0;
    let mut current = samples[0].1;
    for b in 0..buckets {
        let (lo, hi) = (b as f64 * width, (b + 1) as f64 * width);
        let mut m = current;
        while i < samples.len() && samples[i].0 < hi {
            current = samples[i].1;
            m = m.max(current);
            i += 1;
        }
        out.push((lo, m));
        out.push((hi, m));
    }
    out
}

/// Time-weighted average of a piecewise-constant signal per bucket.
fn step_avg(samples: &[(f64, f64)], t_end: f64) -> Vec<(f64, f64)> {
    if samples.is_empty() || t_end <= 0.0 {
        return Vec::new();
    }
    let buckets = 400;
    let width = t_end / buckets as f64;
    let mut acc = vec![0.0; buckets];
    for (j, &(t0, v)) in samples.iter().enumerate() {
        let t1 = samples.get(j + 1).map_or(t_end, |s| s.0).min(t_end);
        let mut t = t0;
        while t < t1 {
            let b = ((t / width) as usize).min(buckets - 1);
            let edge = ((b + 1) as f64 * width).min(t1);
            acc[b] += v * (edge - t);
            if edge <= t {
                break;
            }
            t = edge;
        }
    }
    acc.iter().enumerate().map(|(b, a)| ((b as f64 + 0.5) * width, a / width)).collect()
}

/// Write the two-panel SVG to `path`.
pub fn memory_and_bandwidth(
    path: &Path,
    trace: &Trace,
    r: &SimReport,
    hw: &Hardware,
) -> Result<()> {
    let tl = r
        .timeline
        .as_ref()
        .ok_or_else(|| CliError::Usage("plot: the simulation recorded no timeline".into()))?;
    let t_end_us = if r.iteration_time_us > 0.0 {
        r.iteration_time_us
    } else {
        tl.memory.last().map_or(trace.iteration_time_us(), |m| m.0)
    }
    .max(trace.iteration_time_us());
    let s = |us: f64| us / 1e6;
    let resident = trace.resident_memory_per_kernel();
    let starts = trace.kernel_starts_us();
    let unplanned: Vec<(f64, f64)> =
        resident.iter().enumerate().map(|(k, &m)| (starts[k], m as f64 / 1e9)).collect();
    let planned: Vec<(f64, f64)> = tl.memory.iter().map(|&(t, m)| (t, m as f64 / 1e9)).collect();
    let unplanned = step_max(&unplanned, t_end_us);
    let planned = step_max(&planned, t_end_us);
    let cap_gb = hw.gpu_memory_bytes as f64 / 1e9;
    let y_max = unplanned.iter().chain(planned.iter()).map(|p| p.1).fold(cap_gb, f64::max) * 1.08;

    let root = SVGBackend::new(path, (1200, 900)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let (upper, lower) = root.split_vertically(480);
    let mut chart = ChartBuilder::on(&upper)
        .caption(
            format!(
                "{}: GPU memory, policy {} ({:.1}% of ideal)",
                trace.name, r.policy, r.percent_of_ideal
            ),
            ("sans-serif", 22),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..s(t_end_us), 0f64..y_max)
        .map_err(plot_err)?;
    chart.configure_mesh().x_desc("time (s)").y_desc("GPU memory (GB)").draw().map_err(plot_err)?;
    chart
        .draw_series(LineSeries::new(unplanned.iter().map(|&(t, m)| (s(t), m)), &RED))
        .map_err(plot_err)?
        .label("without plan (all resident, ideal timing)")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED));
    chart
        .draw_series(LineSeries::new(planned.iter().map(|&(t, m)| (s(t), m)), &BLUE))
        .map_err(plot_err)?
        .label("with plan (simulated)")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE));
    chart
        .draw_series(LineSeries::new(
            vec![(0.0, cap_gb), (s(t_end_us), cap_gb)],
            BLACK.stroke_width(2),
        ))
        .map_err(plot_err)?
        .label("capacity")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK));
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(plot_err)?;

    let colors: [RGBColor; Resource::COUNT] =
        [GREEN, MAGENTA, CYAN, RGBColor(230, 140, 0), RGBColor(90, 90, 90), RED, BLUE];
    let series: Vec<(Resource, Vec<(f64, f64)>)> = Resource::ALL
        .iter()
        .map(|&res| {
            let samples: Vec<(f64, f64)> =
                tl.bandwidth.iter().map(|(t, v)| (*t, v[res.index()] / 1e9)).collect();
            (res, step_avg(&samples, t_end_us))
        })
        .collect();
    // A duplex limit left unset never binds (the sum of its two directions): not on the axis.
    let bw_max = Resource::ALL
        .iter()
        .filter(|&&x| x != Resource::PcieDuplex || hw.pcie_duplex_bytes_per_s.is_some())
        .map(|&x| hw.bandwidth(x) / 1e9)
        .fold(1.0, f64::max)
        * 1.05;
    let written =
        r.bytes_moved.iter().find(|b| b.resource == Resource::SsdWrite).map_or(0, |b| b.bytes);
    let caption = format!(
        "bandwidth use (time-averaged); SSD writes {:.1} GB per iteration, drive life {}",
        written as f64 / 1e9,
        crate::cmd::plan::drive_life(r.drive_life_days, hw.ssd_endurance_tbw)
    );
    let mut chart = ChartBuilder::on(&lower)
        .caption(caption, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..s(t_end_us), 0f64..bw_max)
        .map_err(plot_err)?;
    chart.configure_mesh().x_desc("time (s)").y_desc("GB/s").draw().map_err(plot_err)?;
    for ((res, pts), color) in series.into_iter().zip(colors) {
        chart
            .draw_series(LineSeries::new(pts.into_iter().map(|(t, v)| (s(t), v)), color))
            .map_err(plot_err)?
            .label(res.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(plot_err)?;
    root.present().map_err(plot_err)?;
    Ok(())
}
