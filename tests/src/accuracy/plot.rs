//! The PNG figures in docs/statistics.md, drawn with plotters.
//!
//! Text is rendered with ab_glyph from DejaVu Sans (Debian's `fonts-dejavu-core`), so
//! no font library is linked; without the font file the figures cannot be drawn and
//! the error says which package provides it.

use std::path::Path;

use anyhow::{Context, Result};
use plotters::prelude::*;

use super::SiteSummary;

const FONT_PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
];

/// Registers the font plotters draws text with. Call once before drawing.
pub fn register_font() -> Result<()> {
    let path = FONT_PATHS
        .iter()
        .find(|p| Path::new(p).exists())
        .context("DejaVuSans.ttf not found (apt-get install fonts-dejavu-core)")?;
    let bytes: &'static [u8] = Box::leak(std::fs::read(path)?.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
        .map_err(|_| anyhow::anyhow!("{path} is not a usable TrueType font"))?;
    Ok(())
}

fn draw_error<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow::anyhow!("drawing failed: {e:?}")
}

/// One panel of [`estimates_with_intervals`]: a title and, per point, the estimate and
/// its 95% interval divided by the truth.
pub struct RatioPanel {
    /// Panel title.
    pub title: String,
    /// (estimate, lower, upper) / truth.
    pub points: Vec<(f64, f64, f64)>,
    /// X axis label.
    pub x_label: &'static str,
}

impl RatioPanel {
    /// The first `shown` trials of a simulated site.
    pub fn from_trials(site: &SiteSummary, shown: usize) -> RatioPanel {
        let t = site.truth;
        RatioPanel {
            title: format!("simulated {} / {}", site.workload, site.site),
            points: site.trials[..shown.min(site.trials.len())]
                .iter()
                .map(|(e, lo, hi)| (e / t, lo / t, hi / t))
                .collect(),
            x_label: "trial",
        }
    }
}

/// Estimate / truth with its 95% interval, one error bar per point; bars that miss the
/// truth are red.
pub fn estimates_with_intervals(path: &Path, panels: &[RatioPanel]) -> Result<()> {
    let root = BitMapBackend::new(path, (1100, 340 * panels.len() as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(draw_error)?;
    let areas = root.split_evenly((panels.len(), 1));
    for (area, panel) in areas.iter().zip(panels) {
        let points = &panel.points;
        let covered = points
            .iter()
            .filter(|(_, lo, hi)| *lo <= 1.0 && 1.0 <= *hi)
            .count();
        let top = points.iter().map(|p| p.2).fold(1.5f64, f64::max);
        let width = points.len() as f64 + 1.0;
        let mut chart = ChartBuilder::on(area)
            .caption(
                format!(
                    "{}: estimate / truth and 95% interval ({} of {} cover the truth)",
                    panel.title,
                    covered,
                    points.len()
                ),
                ("sans-serif", 18),
            )
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(50)
            .build_cartesian_2d(0f64..width, 0f64..top)
            .map_err(draw_error)?;
        chart
            .configure_mesh()
            .x_desc(panel.x_label)
            .y_desc("estimate / truth")
            .draw()
            .map_err(draw_error)?;
        chart
            .draw_series(LineSeries::new(
                [(0.0, 1.0), (width, 1.0)],
                BLACK.stroke_width(1),
            ))
            .map_err(draw_error)?;
        chart
            .draw_series(points.iter().enumerate().map(|(i, &(est, lo, hi))| {
                let color = if lo <= 1.0 && 1.0 <= hi { BLUE } else { RED };
                ErrorBar::new_vertical(i as f64 + 1.0, lo, est, hi, color.filled(), 6)
            }))
            .map_err(draw_error)?;
    }
    root.present().map_err(draw_error)?;
    Ok(())
}

/// Coverage of the 95% interval against the expected number of samples.
pub fn coverage_curve(path: &Path, points: &[(f64, f64)], trials: usize) -> Result<()> {
    let root = BitMapBackend::new(path, (900, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(draw_error)?;
    let max_lambda = points.iter().map(|p| p.0).fold(1.0, f64::max);
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("Coverage of the 95% interval ({trials} simulated trials per point)"),
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(55)
        .build_cartesian_2d((0.8f64..max_lambda * 1.2).log_scale(), 0.90f64..1.0)
        .map_err(draw_error)?;
    chart
        .configure_mesh()
        .x_desc("expected samples in the group (log scale)")
        .y_desc("fraction of intervals containing the truth")
        .draw()
        .map_err(draw_error)?;
    for (level, color, label) in [
        (0.95, BLACK, "nominal 95%"),
        (0.93, RGBColor(110, 110, 110), "acceptance band 93-97%"),
        (0.97, RGBColor(110, 110, 110), ""),
    ] {
        let series = chart
            .draw_series(LineSeries::new(
                [(0.8, level), (max_lambda * 1.2, level)],
                color.stroke_width(1),
            ))
            .map_err(draw_error)?;
        if !label.is_empty() {
            series
                .label(label)
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], color));
        }
    }
    chart
        .draw_series(LineSeries::new(
            points.iter().copied(),
            BLUE.stroke_width(2),
        ))
        .map_err(draw_error)?
        .label("allocbpf interval (s for the lower end, s+1 for the upper)")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLUE));
    chart
        .draw_series(points.iter().map(|&p| Circle::new(p, 4, BLUE.filled())))
        .map_err(draw_error)?;
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(draw_error)?;
    root.present().map_err(draw_error)?;
    Ok(())
}
