//! `nextn bench --plot FILE.png`: acceptance by draft position (one line per drafting run) and
//! decode tokens/s per run with its standard deviation over the repetitions.

use std::path::Path;

use anyhow::{anyhow, bail, Result};
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

use super::TableRow;

/// Where Debian (and most distributions) keep a sans-serif TrueType font for the labels.
const FONTS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
];

/// One colour per draft depth, distinct on white (a qualitative palette without yellow).
const SERIES_COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(23, 190, 207),
];

fn register_label_font() -> Result<()> {
    for f in FONTS {
        if let Ok(bytes) = std::fs::read(f) {
            // plotters keeps registered fonts for the life of the process.
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            return register_font("sans-serif", FontStyle::Normal, bytes)
                .map_err(|_| anyhow!("--plot: {f} is not a usable TrueType font"));
        }
    }
    bail!(
        "--plot needs a TrueType font for its labels and found none of {} (Debian: apt-get install fonts-dejavu-core)",
        FONTS.join(", ")
    )
}

pub fn plot(path: &Path, rows: &[TableRow]) -> Result<()> {
    if rows.is_empty() {
        bail!("--plot: no runs to draw");
    }
    register_label_font()?;
    let root = BitMapBackend::new(path, (1200, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let (left, right) = root.split_horizontally(600);

    let max_pos = rows
        .iter()
        .map(|r| r.per_position.len())
        .max()
        .unwrap_or(0)
        .max(1);
    let mut acc = ChartBuilder::on(&left)
        .caption("Acceptance by draft position", ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(55)
        .build_cartesian_2d(0.5f64..max_pos as f64 + 0.5, 0f64..1.0)?;
    acc.configure_mesh()
        .x_desc("draft position")
        .y_desc("accepted / drafted")
        .x_labels(max_pos)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .label_style(("sans-serif", 15))
        .draw()?;
    for (i, r) in rows
        .iter()
        .filter(|r| !r.per_position.is_empty())
        .enumerate()
    {
        let color = SERIES_COLORS[i % SERIES_COLORS.len()].to_rgba();
        let points: Vec<(f64, f64)> = r
            .per_position
            .iter()
            .enumerate()
            .map(|(p, &a)| (p as f64 + 1.0, a))
            .collect();
        acc.draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))?
            .label(format!("n_max {} {}", r.n_max, r.drafts))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
        acc.draw_series(
            points
                .into_iter()
                .map(|p| Circle::new(p, 4, color.filled())),
        )?;
    }
    // Acceptance starts high and falls with the position, so the lower left stays clear.
    acc.configure_series_labels()
        .position(SeriesLabelPosition::LowerLeft)
        .label_font(("sans-serif", 15))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;

    let top = rows
        .iter()
        .map(|r| r.decode.0 + r.decode.1)
        .fold(0.0f64, f64::max)
        .max(1.0)
        * 1.15;
    let labels: Vec<String> = rows
        .iter()
        .map(|r| match r.drafts.as_str() {
            "-" => "plain".to_string(),
            d => format!("{} {d}", r.n_max),
        })
        .collect();
    let mut speed = ChartBuilder::on(&right)
        .caption("Decode tokens/s by draft depth", ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..rows.len() as f64, 0f64..top)?;
    speed
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(rows.len() * 2 + 1)
        .x_label_formatter(&|x| {
            let i = x.floor() as usize;
            if (x - x.floor() - 0.5).abs() < 1e-6 {
                labels.get(i).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_desc("tokens/s (mean ± sd)")
        .y_label_formatter(&|y| format!("{y:.0}"))
        .label_style(("sans-serif", 15))
        .draw()?;
    for (i, r) in rows.iter().enumerate() {
        let x = i as f64;
        let color = if r.drafts == "-" {
            RGBColor(150, 150, 150)
        } else {
            RGBColor(37, 87, 214)
        };
        speed.draw_series(std::iter::once(Rectangle::new(
            [(x + 0.2, 0.0), (x + 0.8, r.decode.0)],
            color.filled(),
        )))?;
        let (m, sd) = r.decode;
        speed.draw_series(std::iter::once(ErrorBar::new_vertical(
            x + 0.5,
            (m - sd).max(0.0),
            m,
            m + sd,
            BLACK.stroke_width(2),
            14,
        )))?;
    }
    root.present()?;
    Ok(())
}
