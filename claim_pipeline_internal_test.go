package outbox

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	"gorm.io/driver/postgres"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// A claim's transaction on PostgreSQL sends BEGIN with its first statement
// and COMMIT with its lease. Whatever fails, and wherever, it commits
// exactly when the claim succeeds, and hands the connection back to the
// pool outside any transaction, to be used again: on a pool of one
// connection, the next write runs in the same session, commits, and other
// sessions see it.
func TestPostgresClaimTransactionCommitsOnlyAClaimThatSucceeds(t *testing.T) {
	insert := func(v string) string { return `INSERT INTO probe VALUES ('` + v + `') RETURNING v` }
	read := func(res resultRows, err error) error {
		if err != nil {
			return err
		}
		for res.Next() {
		}
		return errors.Join(res.Err(), res.Close())
	}
	for _, tc := range []struct {
		name    string
		fn      func(ctx context.Context, q claimQuerier) error
		wantErr string   // in the claim's error; "" for none
		want    []string // rows of probe after the claim
	}{
		{"a window with nothing to lease commits", func(ctx context.Context, q claimQuerier) error {
			return read(q.query(ctx, insert("window")))
		}, "", []string{"window"}},
		{"a lease commits with the statements before it", func(ctx context.Context, q claimQuerier) error {
			if err := read(q.query(ctx, insert("window"))); err != nil {
				return err
			}
			if err := read(q.query(ctx, insert("lookup"))); err != nil {
				return err
			}
			return read(q.lease(ctx, insert("lease")))
		}, "", []string{"lease", "lookup", "window"}},
		{"a failed first statement rolls back", func(ctx context.Context, q claimQuerier) error {
			return read(q.query(ctx, `SELECT 1 / (SELECT count(*) FROM probe)::int`))
		}, "division by zero", nil},
		{"an error between the statements rolls back", func(ctx context.Context, q claimQuerier) error {
			if err := read(q.query(ctx, insert("window"))); err != nil {
				return err
			}
			return errors.New("picked nothing")
		}, "picked nothing", nil},
		{"a failed lookup rolls back", func(ctx context.Context, q claimQuerier) error {
			if err := read(q.query(ctx, insert("window"))); err != nil {
				return err
			}
			return read(q.query(ctx, `SELECT 1 / (SELECT count(*) - 1 FROM probe)::int`))
		}, "division by zero", nil},
		{"a failed lease rolls back what came before", func(ctx context.Context, q claimQuerier) error {
			if err := read(q.query(ctx, insert("window"))); err != nil {
				return err
			}
			return read(q.lease(ctx, `SELECT 1 / (SELECT count(*) - 1 FROM probe)::int`))
		}, "division by zero", nil},
		{"a cancelled claim rolls back", func(ctx context.Context, q claimQuerier) error {
			if err := read(q.query(ctx, insert("window"))); err != nil {
				return err
			}
			ctx, cancel := context.WithCancel(ctx)
			cancel()
			return read(q.lease(ctx, insert("lease")))
		}, "context canceled", nil},
	} {
		for _, simple := range []bool{false, true} {
			name := tc.name
			if simple {
				name += ", simple protocol"
			}
			t.Run(name, func(t *testing.T) {
				_, info := outboxtest.Open(t, outboxtest.Postgres, nil)
				db, err := gorm.Open(postgres.New(postgres.Config{DSN: info.DSN, PreferSimpleProtocol: simple}), &gorm.Config{})
				if err != nil {
					t.Fatal(err)
				}
				sqlDB, err := db.DB()
				if err != nil {
					t.Fatal(err)
				}
				defer sqlDB.Close()
				sqlDB.SetMaxOpenConns(1)
				if err := db.Exec(`CREATE TABLE probe (v text)`).Error; err != nil {
					t.Fatal(err)
				}

				var pid, pidAfter int64
				if err := db.Raw(`SELECT pg_backend_pid()`).Scan(&pid).Error; err != nil {
					t.Fatal(err)
				}
				ctx := context.Background()
				err = postgresDialect{}.claimTx(ctx, db, func(q claimQuerier) error { return tc.fn(ctx, q) })
				switch {
				case tc.wantErr == "" && err != nil:
					t.Fatalf("claim failed: %v", err)
				case tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)):
					t.Fatalf("claim error %v, want one about %q", err, tc.wantErr)
				}

				if err := db.Exec(`INSERT INTO probe VALUES ('after')`).Error; err != nil {
					t.Fatalf("the pool's connection after the claim: %v", err)
				}
				if err := db.Raw(`SELECT pg_backend_pid()`).Scan(&pidAfter).Error; err != nil {
					t.Fatal(err)
				}
				if pidAfter != pid {
					t.Errorf("the pool replaced its connection (server process %d, then %d): the claim left it unusable", pid, pidAfter)
				}
				var got []string
				other := outboxtest.Reopen(t, info, nil)
				if err := other.Raw(`SELECT v FROM probe ORDER BY v`).Scan(&got).Error; err != nil {
					t.Fatal(err)
				}
				if want := append(slices.Clone(tc.want), "after"); !slices.Equal(got, sortedStrings(want)) {
					t.Fatalf("committed rows %q, want %q", got, sortedStrings(want))
				}
			})
		}
	}
}

func sortedStrings(s []string) []string {
	s = slices.Clone(s)
	slices.Sort(s)
	return s
}
