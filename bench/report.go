package main

import (
	"fmt"
	"io"
	"math"
	"os"
	"runtime"
	"sort"
	"strings"
	"text/tabwriter"
	"time"
)

// figure is one measured number, printed at the end as "name value unit".
type figure struct {
	name  string
	value float64
	unit  string
}

// report collects the figures of a run and prints tables as scenarios
// finish.
type report struct {
	out     io.Writer
	figures []figure
	byName  map[string]float64
}

func newReport(out io.Writer) *report {
	return &report{out: out, byName: map[string]float64{}}
}

// add records a figure. A NaN or infinite value (a ratio with a zero
// denominator) is not recorded.
func (r *report) add(name string, value float64, unit string) {
	if math.IsNaN(value) || math.IsInf(value, 0) {
		return
	}
	r.figures = append(r.figures, figure{name, value, unit})
	r.byName[name] = value
}

// get returns a recorded figure.
func (r *report) get(name string) (float64, bool) {
	v, ok := r.byName[name]
	return v, ok
}

// ratio records num/den as a ratio figure, if both were measured.
func (r *report) ratio(name, num, den string) {
	n, ok1 := r.get(num)
	d, ok2 := r.get(den)
	if ok1 && ok2 && d > 0 {
		r.add(name, n/d, "ratio")
	}
}

// table prints a titled table: a header row, then rows.
func (r *report) table(title string, header []string, rows [][]string) {
	fmt.Fprintf(r.out, "== %s\n", title)
	tw := tabwriter.NewWriter(r.out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, strings.Join(header, "\t")+"\t")
	for _, row := range rows {
		fmt.Fprintln(tw, strings.Join(row, "\t")+"\t")
	}
	tw.Flush()
	fmt.Fprintln(r.out)
}

// note prints a line under the current scenario.
func (r *report) note(format string, args ...any) {
	fmt.Fprintf(r.out, format+"\n", args...)
}

// printFigures prints every figure as "name value unit", in the order they
// were measured.
func (r *report) printFigures() {
	fmt.Fprintln(r.out, "== figures (name value unit)")
	for _, f := range r.figures {
		fmt.Fprintf(r.out, "%s %s %s\n", f.name, formatValue(f.value, f.unit), f.unit)
	}
}

func formatValue(v float64, unit string) string {
	switch unit {
	case "ratio":
		return fmt.Sprintf("%.2f", v)
	case "ms":
		return fmt.Sprintf("%.2f", v)
	default:
		return fmt.Sprintf("%.1f", v)
	}
}

func rate(n int, d time.Duration) float64 {
	if d <= 0 {
		return 0
	}
	return float64(n) / d.Seconds()
}

func f1(v float64) string { return fmt.Sprintf("%.1f", v) }
func f2(v float64) string { return fmt.Sprintf("%.2f", v) }

// ratioCell formats num/den for a table, or "-" when den is zero.
func ratioCell(num, den float64) string {
	if den <= 0 {
		return "-"
	}
	return f2(num / den)
}

// percentile returns the p-th percentile (0 < p <= 100) of sorted values,
// by the nearest-rank method.
func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	rank := int(math.Ceil(p / 100 * float64(len(sorted))))
	rank = min(max(rank, 1), len(sorted))
	return sorted[rank-1]
}

func sortDurations(d []time.Duration) {
	sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func numCPU() int { return runtime.NumCPU() }

// sizeName writes an event count short: 10000 → 10k, 1000000 → 1m.
func sizeName(n int) string {
	switch {
	case n >= 1_000_000 && n%1_000_000 == 0:
		return fmt.Sprintf("%dm", n/1_000_000)
	case n >= 1000 && n%1000 == 0:
		return fmt.Sprintf("%dk", n/1000)
	default:
		return fmt.Sprintf("%d", n)
	}
}

// loadAverage returns the 1, 5 and 15 minute load averages of the machine,
// where /proc tells them.
func loadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "unknown"
	}
	return strings.Join(f[:3], " ")
}
