package outbox_test

import (
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// TestDispatcherProcessesShareOneTable runs three dispatcher processes on
// one database (on SQLite, one file) with a publisher that fails every
// third batch, and checks that each committed event is accepted exactly
// once, in order per aggregate.
func TestDispatcherProcessesShareOneTable(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		out := filepath.Join(t.TempDir(), "accepted.jsonl")
		for range 3 {
			startDispatcherProcess(t, helperConfig{Engine: e, DSN: b.info.DSN, Out: out, Lease: time.Minute, FailEvery: 3})
		}
		committed := map[string]bool{}
		for i := range 200 {
			o := Order{Status: fmt.Sprint(i)}
			mustNil(t, b.db.Create(&o).Error)
			mustNil(t, b.db.Model(&o).Update("status", "paid").Error)
		}
		for _, r := range b.records(t) {
			committed[r.EventID] = true
		}
		deadline := time.Now().Add(60 * time.Second)
		for len(readAcceptances(t, out)) < len(committed) && time.Now().Before(deadline) {
			time.Sleep(50 * time.Millisecond)
		}
		as := readAcceptances(t, out)
		if redelivered := checkAcceptances(t, as, committed); redelivered != 0 {
			t.Errorf("%d redeliveries without a kill or an expired lease", redelivered)
		}
		pids := map[int]int{}
		for _, a := range as {
			pids[a.PID]++
		}
		t.Logf("%d events accepted by %d processes: %v", len(as), len(pids), pids)
	})
}
