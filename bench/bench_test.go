package main

import (
	"bytes"
	"context"
	"database/sql"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"
)

// TestSmoke runs the whole benchmark in smoke mode: tiny backlogs, short
// durations. It checks that every scenario runs to the end and prints its
// figures; it asserts nothing about speed.
func TestSmoke(t *testing.T) {
	c := smokeConfig(defaultConfig())
	if err := pingPostgres(c.dsn); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("PostgreSQL at %q does not answer (CI=true, so this fails instead of skipping): %v", c.dsn, err)
		}
		t.Skipf("skipping: no PostgreSQL server at %q (set OUTBOX_POSTGRES_DSN): %v", c.dsn, err)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var out bytes.Buffer
	if err := run(ctx, c, &out); err != nil {
		t.Fatalf("run: %v\noutput:\n%s", err, out.String())
	}
	t.Log(out.String())

	text := out.String()
	i := strings.Index(text, "== figures (name value unit)\n")
	if i < 0 {
		t.Fatal("no figures section in the output")
	}
	line := regexp.MustCompile(`^[a-z0-9_]+ -?[0-9]+(\.[0-9]+)? (tx/s|events/s|ms|ratio)$`)
	got := map[string]bool{}
	for _, l := range strings.Split(text[i:], "\n")[1:] {
		if l == "" || strings.HasPrefix(l, "(total") {
			continue
		}
		if !line.MatchString(l) {
			t.Errorf("figure line %q is not \"name value unit\"", l)
			continue
		}
		got[strings.Fields(l)[0]] = true
	}
	for _, want := range []string{
		"write_plain_1c", "write_plugin_8c", "write_ratio_c_over_b_1c", "write_sqlite_plugin_1c",
		"dispatch_outbox_1d_b1000", "dispatch_raw_4d_b1000", "dispatch_river", "dispatch_watermill_default",
		"dispatch_watermill_b1000", "dispatch_sqlite_outbox_1d_b1000",
		"latency_notify_p50", "latency_notify_p99", "latency_poll_p99",
		"backlog_ratio_big_over_small", "backlog_ratio_raw_big_over_small",
	} {
		if !got[want] {
			t.Errorf("figure %s missing", want)
		}
	}
}

func pingPostgres(dsn string) error {
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		return err
	}
	defer db.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return db.PingContext(ctx)
}
