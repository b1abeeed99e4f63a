package outbox_test

import (
	"errors"
	"fmt"
	"sync"
	"testing"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// TestConcurrentWritersGetGaplessSequences: 8 goroutines run hundreds of
// transactions on one aggregate, a quarter of them rolled back; the
// committed events are numbered 1..n exactly once each, and their order
// matches the order of the rows' commits.
func TestConcurrentWritersGetGaplessSequences(t *testing.T) {
	for _, e := range outboxtest.Engines {
		t.Run(string(e), func(t *testing.T) {
			t.Parallel()
			b := setup(t, e, nil)
			const writers, perWriter = 8, 48
			var (
				wg        sync.WaitGroup
				mu        sync.Mutex
				committed []string
			)
			for w := range writers {
				db := outboxtest.Reopen(t, b.info, nil)
				mustNil(t, db.Use(outbox.Plugin()))
				wg.Add(1)
				go func() {
					defer wg.Done()
					for i := range perWriter {
						key := fmt.Sprintf("w%d-%d", w, i)
						rollback := i%4 == 0
						// InnoDB may end one of the first writers of a new
						// aggregate for a deadlock: an application runs it
						// again, as this writer does.
						err := againAfterDeadlocks(func() error {
							return db.Transaction(func(tx *gorm.DB) error {
								if err := tx.Create(&Order{Status: key}).Error; err != nil {
									return err
								}
								if err := outbox.Publish(tx, outbox.Event{Type: "order.noted", AggregateType: "shop", AggregateID: "one", IdempotencyKey: key}); err != nil {
									return err
								}
								if rollback {
									return errRollback
								}
								return nil
							})
						})
						if (rollback && !errors.Is(err, errRollback)) || (!rollback && err != nil) {
							t.Errorf("transaction %s: %v", key, err)
							return
						}
						if !rollback {
							mu.Lock()
							committed = append(committed, key)
							mu.Unlock()
						}
					}
				}()
			}
			wg.Wait()
			var rows []struct {
				AggregateSequence int64
				IdempotencyKey    string
			}
			mustNil(t, b.db.Raw(`SELECT aggregate_sequence, idempotency_key FROM outbox_records WHERE aggregate_type = 'shop' ORDER BY aggregate_sequence`).Scan(&rows).Error)
			want := writers * perWriter * 3 / 4
			if len(rows) != want || len(committed) != want {
				t.Fatalf("%d events stored, %d transactions committed; want %d", len(rows), len(committed), want)
			}
			isCommitted := map[string]bool{}
			for _, k := range committed {
				isCommitted[k] = true
			}
			// One writer commits its transactions one after another, so its
			// events must carry increasing sequences.
			lastOfWriter := map[string]int{}
			for i, r := range rows {
				if r.AggregateSequence != int64(i+1) {
					t.Fatalf("sequence %d at position %d: a gap or a duplicate", r.AggregateSequence, i+1)
				}
				if !isCommitted[r.IdempotencyKey] {
					t.Fatalf("event %s of a rolled-back transaction was stored", r.IdempotencyKey)
				}
				var w, n int
				fmt.Sscanf(r.IdempotencyKey, "w%d-%d", &w, &n)
				if last, seen := lastOfWriter[fmt.Sprint(w)]; seen && n < last {
					t.Fatalf("writer %d: transaction %d got a sequence after its later transaction %d", w, n, last)
				}
				lastOfWriter[fmt.Sprint(w)] = n
			}
		})
	}
}

var errRollback = errors.New("roll back on purpose")
