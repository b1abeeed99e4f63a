package outboxtest

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"sync/atomic"
	"testing"
	"time"
)

// Unreachable ends t because the server it needs did not answer: server
// names it ("PostgreSQL", "NATS"), addr is where it was asked, env the
// variable that sets addr, and err what the attempt returned. t skips
// with a message naming env, or, under CI=true, fails, so that a CI run
// without its servers cannot pass by skipping.
func Unreachable(t testing.TB, server, addr, env string, err error) {
	t.Helper()
	if os.Getenv("CI") == "true" {
		t.Fatalf("outboxtest: %s at %q does not answer (CI=true, so this fails instead of skipping): %v", server, addr, err)
	}
	t.Skipf("outboxtest: skipping: no %s server at %q (set %s): %v", server, addr, env, err)
}

// openAdmin opens the database/sql driver named driver on dsn and pings
// it for up to five seconds; when the server does not answer it ends t as
// Unreachable does. The caller closes the pool.
func openAdmin(t testing.TB, driver, dsn, server, env string) *sql.DB {
	t.Helper()
	admin, err := sql.Open(driver, dsn)
	if err == nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		err = admin.PingContext(ctx)
		cancel()
	}
	if err != nil {
		if admin != nil {
			admin.Close()
		}
		Unreachable(t, server, dsn, env, err)
	}
	return admin
}

var schemaSeq atomic.Int64

// uniqueName names a schema or database no other test, process or
// earlier run on the same server uses.
func uniqueName() string {
	return fmt.Sprintf("outbox_test_%d_%d_%d", os.Getpid(), time.Now().UnixNano()%1e9, schemaSeq.Add(1))
}
