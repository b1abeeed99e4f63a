package outbox

import (
	"context"
	"database/sql/driver"
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
		err = res.Err()
		if cerr := res.Close(); err == nil {
			err = cerr
		}
		return err
	}
	type step = func(ctx context.Context, q claimQuerier, p *claimProbe) error
	// afterWindow runs then after a first statement that writes "window".
	afterWindow := func(then step) step {
		return func(ctx context.Context, q claimQuerier, p *claimProbe) error {
			if err := read(q.query(ctx, insert("window"))); err != nil {
				return err
			}
			return then(ctx, q, p)
		}
	}
	const divideByZero = `SELECT 1 / (SELECT count(*) - 1 FROM probe)::int` // after "window"
	for _, tc := range []struct {
		name    string
		fn      step
		wantErr string   // in the claim's error; "" for none
		want    []string // rows of probe after the claim
	}{
		{"a window with nothing to lease commits", afterWindow(func(context.Context, claimQuerier, *claimProbe) error {
			return nil
		}), "", []string{"window"}},
		{"a lease commits with the statements before it", afterWindow(func(ctx context.Context, q claimQuerier, _ *claimProbe) error {
			if err := read(q.query(ctx, insert("lookup"))); err != nil {
				return err
			}
			return read(q.lease(ctx, insert("lease")))
		}), "", []string{"lease", "lookup", "window"}},
		{"a failed first statement rolls back", func(ctx context.Context, q claimQuerier, _ *claimProbe) error {
			return read(q.query(ctx, `SELECT 1 / (SELECT count(*) FROM probe)::int`))
		}, "division by zero", nil},
		{"an error between the statements rolls back", afterWindow(func(context.Context, claimQuerier, *claimProbe) error {
			return errors.New("picked nothing")
		}), "picked nothing", nil},
		{"a failed lookup rolls back", afterWindow(func(ctx context.Context, q claimQuerier, _ *claimProbe) error {
			return read(q.query(ctx, divideByZero))
		}), "division by zero", nil},
		{"a failed lease rolls back what came before", afterWindow(func(ctx context.Context, q claimQuerier, _ *claimProbe) error {
			return read(q.lease(ctx, divideByZero))
		}), "division by zero", nil},
		{"a cancelled claim rolls back", afterWindow(func(ctx context.Context, q claimQuerier, p *claimProbe) error {
			p.cancel()
			return read(q.lease(ctx, insert("lease")))
		}), "context canceled", nil},
		{"a claim whose connection is lost is discarded", afterWindow(func(ctx context.Context, q claimQuerier, p *claimProbe) error {
			p.terminate()
			return read(q.lease(ctx, insert("lease")))
		}), lostConnection, nil},
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
				other := outboxtest.Reopen(t, info, nil)
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				p := &claimProbe{cancel: cancel, terminate: func() {
					if err := other.Exec(`SELECT pg_terminate_backend(?)`, pid).Error; err != nil {
						t.Error(err)
					}
				}}
				err = postgresDialect{}.claimTx(ctx, db, func(q claimQuerier) error {
					if _, ok := q.(*pgxClaim); !ok {
						t.Fatalf("the claim ran on a %T, not pipelined", q)
					}
					return tc.fn(ctx, q, p)
				})
				switch {
				case tc.wantErr == "" && err != nil:
					t.Fatalf("claim failed: %v", err)
				case tc.wantErr == lostConnection && !errors.Is(err, driver.ErrBadConn):
					t.Fatalf("claim error %v, want one that makes the pool discard the connection", err)
				case tc.wantErr != "" && tc.wantErr != lostConnection && (err == nil || !strings.Contains(err.Error(), tc.wantErr)):
					t.Fatalf("claim error %v, want one about %q", err, tc.wantErr)
				}
				if err != nil {
					seen := map[string]bool{}
					for _, line := range strings.Split(err.Error(), "\n") {
						if seen[line] {
							t.Errorf("claim error %q repeats itself", err)
						}
						seen[line] = true
					}
				}

				if err := db.Exec(`INSERT INTO probe VALUES ('after')`).Error; err != nil {
					t.Fatalf("the pool's connection after the claim: %v", err)
				}
				if err := db.Raw(`SELECT pg_backend_pid()`).Scan(&pidAfter).Error; err != nil {
					t.Fatal(err)
				}
				if lost := tc.wantErr == lostConnection; lost != (pidAfter != pid) {
					t.Errorf("server process %d before the claim, %d after it: want the connection kept unless it was lost", pid, pidAfter)
				}
				var got []string
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

// lostConnection is the wantErr of a claim whose connection is lost: its
// error must tell database/sql to discard the connection.
const lostConnection = "(connection lost)"

// claimProbe is what a case does to its claim from outside.
type claimProbe struct {
	cancel    func() // cancels the claim's context
	terminate func() // ends the claim's server session from another one
}

func sortedStrings(s []string) []string {
	s = slices.Clone(s)
	slices.Sort(s)
	return s
}
