package outboxprom_test

import (
	"context"
	"encoding/json"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"go.yaml.in/yaml/v2"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// exposedSeries returns the series names a scrape of a watched Metrics
// shows, with the _bucket, _sum and _count series of histograms.
func exposedSeries(t *testing.T) map[string]bool {
	t.Helper()
	db := openOutbox(t, outboxtest.SQLite)
	m, reg := newMetrics(t)
	d := newDispatcher(t, db, outbox.PublisherFunc(func(context.Context, outbox.Batch) error { return nil }))
	if err := m.Watch(d); err != nil {
		t.Fatal(err)
	}
	// A counter vector shows once it has a series.
	if err := m.Wrap(outbox.PublisherFunc(func(context.Context, outbox.Batch) error { return nil })).Publish(context.Background(), outbox.Batch{ID: "b", Messages: []outbox.Message{{EventID: "e", EventType: "t"}}}); err != nil {
		t.Fatal(err)
	}
	names := map[string]bool{}
	for name, mf := range scrape(t, reg) {
		names[name] = true
		if mf.GetType() == dto.MetricType_HISTOGRAM {
			names[name+"_bucket"], names[name+"_sum"], names[name+"_count"] = true, true, true
		}
	}
	return names
}

var metricName = regexp.MustCompile(`\boutbox_[a-z_]+`)

// checkNames fails unless every outbox metric expr names is exposed.
func checkNames(t *testing.T, where, expr string, exposed map[string]bool) {
	t.Helper()
	found := metricName.FindAllString(expr, -1)
	if len(found) == 0 {
		t.Errorf("%s: %q uses no outbox metric", where, expr)
	}
	for _, n := range found {
		if !exposed[n] {
			t.Errorf("%s: %q uses %s, which outboxprom does not expose", where, expr, n)
		}
	}
}

func TestAlertRulesParseAndUseExposedMetrics(t *testing.T) {
	raw, err := os.ReadFile("../docs/alerts.yml")
	if err != nil {
		t.Fatal(err)
	}
	var file struct {
		Groups []struct {
			Name  string `yaml:"name"`
			Rules []struct {
				Alert       string            `yaml:"alert"`
				Expr        string            `yaml:"expr"`
				For         string            `yaml:"for"`
				Labels      map[string]string `yaml:"labels"`
				Annotations map[string]string `yaml:"annotations"`
			} `yaml:"rules"`
		} `yaml:"groups"`
	}
	if err := yaml.UnmarshalStrict(raw, &file); err != nil {
		t.Fatalf("docs/alerts.yml: %v", err)
	}
	exposed := exposedSeries(t)
	var alerts []string
	for _, g := range file.Groups {
		for _, r := range g.Rules {
			alerts = append(alerts, r.Alert)
			checkNames(t, r.Alert, r.Expr, exposed)
			if _, err := time.ParseDuration(r.For); err != nil {
				t.Errorf("%s: for: %v", r.Alert, err)
			}
			if r.Labels["severity"] == "" || r.Annotations["summary"] == "" || r.Annotations["description"] == "" {
				t.Errorf("%s: want a severity label and summary and description annotations", r.Alert)
			}
		}
	}
	if got := strings.Join(alerts, ","); got != "OutboxLagHigh,OutboxFailedMessages" {
		t.Fatalf("alerts %s, want OutboxLagHigh,OutboxFailedMessages", got)
	}
}

func TestGrafanaDashboardIsValidJSONOnExposedMetrics(t *testing.T) {
	raw, err := os.ReadFile("../docs/grafana-dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Title         string `json:"title"`
		UID           string `json:"uid"`
		SchemaVersion int    `json:"schemaVersion"`
		Panels        []struct {
			ID      int    `json:"id"`
			Title   string `json:"title"`
			Type    string `json:"type"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(raw, &dash); err != nil {
		t.Fatalf("docs/grafana-dashboard.json: %v", err)
	}
	if dash.Title == "" || dash.UID == "" || dash.SchemaVersion == 0 || len(dash.Panels) == 0 {
		t.Fatalf("dashboard lacks a title, uid, schemaVersion or panels")
	}
	exposed := exposedSeries(t)
	used := map[string]bool{}
	ids := map[int]bool{}
	for _, p := range dash.Panels {
		if ids[p.ID] {
			t.Errorf("panel id %d used twice", p.ID)
		}
		ids[p.ID] = true
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, tg := range p.Targets {
			checkNames(t, p.Title, tg.Expr, exposed)
			for _, n := range metricName.FindAllString(tg.Expr, -1) {
				used[strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(n, "_bucket"), "_sum"), "_count")] = true
			}
		}
	}
	for name := range exposed {
		if !used[name] && !strings.HasSuffix(name, "_bucket") && !strings.HasSuffix(name, "_sum") && !strings.HasSuffix(name, "_count") {
			t.Errorf("the dashboard shows nothing of %s", name)
		}
	}
}
