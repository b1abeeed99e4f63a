package outbox_test

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// summary reports the figures of a crash, fault or load test: in the test
// log, and as one line on standard output prefixed "outbox-suite:", so that
// `go test -v ... | grep outbox-suite:` collects the figures of a run.
func summary(t *testing.T, format string, args ...any) {
	t.Helper()
	line := fmt.Sprintf(format, args...)
	t.Log(line)
	fmt.Println("outbox-suite: " + line)
}

// waitAllDelivered waits until every row of the outbox table is delivered,
// and fails the test, listing the rows left, if that takes longer than
// timeout.
func waitAllDelivered(t *testing.T, db *gorm.DB, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		var left int64
		err := db.Raw(`SELECT count(*) FROM outbox_records WHERE delivery_state <> 'delivered'`).Scan(&left).Error
		if err == nil && left == 0 {
			return
		}
		if time.Now().After(deadline) {
			for _, r := range outboxtest.Records(t, db, outbox.DefaultTable) {
				if r.DeliveryState != outbox.StateDelivered {
					t.Logf("undelivered: %s/%s #%d %s, %d attempts, next attempt %v, locked until %v, batch %s, last error %q",
						r.AggregateType, r.AggregateID, r.AggregateSequence, r.DeliveryState, r.DeliveryAttempts,
						r.NextAttemptAt.Format(time.StampMilli), r.LockedUntil.Time.Format(time.StampMilli), r.BatchID.String, r.LastError.String)
				}
			}
			t.Fatalf("%d events still undelivered %v after the run (last error %v)", left, timeout, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestSQLiteTestDatabasesAreSeparate: outboxtest.Open promises each test a
// fresh SQLite file in the test's temporary directory. The directory's
// name comes from the test's name, and SQLite reads the DSN as a file: URI,
// which ends the path at a '#'. So every test whose name holds a '#' (the
// seeds of a fuzz target, "seed#0"; a repeated subtest name, "x#01")
// opens the same file beside the temporary directories, shared between
// tests and kept from one run to the next.
//
// This test fails until outboxtest.SQLiteDSN escapes the path (see the
// report of the crash and fault suite).
func TestSQLiteTestDatabasesAreSeparate(t *testing.T) {
	t.Run("seed#0", func(t *testing.T) {
		db, _ := outboxtest.Open(t, outboxtest.SQLite, nil)
		var files []struct {
			Name string
			File string
		}
		mustNil(t, db.Raw(`PRAGMA database_list`).Scan(&files).Error)
		root := filepath.Dir(t.TempDir())
		for _, f := range files {
			if f.Name == "main" && !strings.HasPrefix(f.File, root+string(filepath.Separator)) {
				t.Cleanup(func() {
					for _, suffix := range []string{"", "-wal", "-shm"} {
						os.Remove(f.File + suffix)
					}
				})
				t.Errorf("the test's database is %s, outside its temporary directory %s", f.File, root)
			}
		}
	})
}
