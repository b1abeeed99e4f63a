package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
	"github.com/gorm-outbox/outbox/internal/outboxtest/deliveries"
)

// TestWritersWhoseXidOrderDiffersFromCommitOrderAreDeliveredInOrder: while
// three dispatchers deliver, eight writers commit transactions that write
// a business row first and then, after a pause, an event of one of five
// aggregates, so that the order in which transactions took their ids
// differs from the order in which their events took the sequence; and
// another session holds a transaction that wrote a row open for the whole
// run (PostgreSQL and MySQL; SQLite has one writer at a time, so there the
// open transaction would only stop the writers). Every committed event is
// accepted, none of a rolled-back transaction is, and per aggregate the
// first acceptances come 1, 2, 3, ...
func TestWritersWhoseXidOrderDiffersFromCommitOrderAreDeliveredInOrder(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		mustNil(t, b.db.Exec(`CREATE TABLE held (id integer PRIMARY KEY)`).Error)
		if e != outboxtest.SQLite {
			open := b.db.Begin()
			mustNil(t, open.Error)
			mustNil(t, open.Exec(`INSERT INTO held (id) VALUES (1)`).Error)
			defer open.Rollback()
		}

		var (
			order     deliveries.OrderChecker
			mu        sync.Mutex
			accepted  = map[string]bool{}
			committed sync.Map // event id -> true
			written   atomic.Bool
		)
		pub := outbox.PublisherFunc(func(_ context.Context, batch outbox.Batch) error {
			mu.Lock()
			defer mu.Unlock()
			for _, m := range batch.Messages {
				if err := order.Accept(m); err != nil {
					t.Error(err)
				}
				accepted[m.EventID] = true
			}
			return nil
		})

		const writers, perWriter = 8, 25
		var wg sync.WaitGroup
		for w := range writers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := range perWriter {
					id := fmt.Sprintf("w%d-%d", w, i)
					rollback := i%9 == 4
					err := b.db.Transaction(func(tx *gorm.DB) error {
						if err := outbox.WithoutEvents(tx).Create(&Order{Status: id}).Error; err != nil {
							return err
						}
						time.Sleep(time.Duration(rand.IntN(3)) * time.Millisecond)
						if err := outbox.Publish(tx, outbox.Event{ID: id, Type: "t", AggregateType: "agg",
							AggregateID: fmt.Sprint(rand.IntN(5)), Payload: map[string]string{"id": id}}); err != nil {
							return err
						}
						time.Sleep(time.Duration(rand.IntN(3)) * time.Millisecond)
						if rollback {
							return errRollback
						}
						return nil
					})
					switch {
					case rollback && errors.Is(err, errRollback):
					case err != nil:
						t.Errorf("writer %d: %v", w, err)
						return
					default:
						committed.Store(id, true)
					}
				}
			}()
		}

		var dwg sync.WaitGroup
		deadline := time.Now().Add(90 * time.Second)
		for range 3 {
			db := outboxtest.Reopen(t, b.info, nil)
			mustNil(t, db.Use(outbox.Plugin(outbox.WithPluginLogger(outboxtest.Logger(t)))))
			d := newDispatcher(t, db, pub, outbox.WithBatchSize(5), outbox.WithPollInterval(5*time.Millisecond))
			dwg.Add(1)
			go func() {
				defer dwg.Done()
				idle := 0
				for time.Now().Before(deadline) {
					n, err := d.DispatchOnce(context.Background())
					if err != nil {
						t.Errorf("DispatchOnce: %v", err)
						return
					}
					if n == 0 {
						if written.Load() {
							if idle++; idle > 20 {
								return
							}
						}
						time.Sleep(5 * time.Millisecond)
						continue
					}
					idle = 0
				}
			}()
		}
		wg.Wait()
		written.Store(true)
		dwg.Wait()

		mu.Lock()
		defer mu.Unlock()
		n := 0
		committed.Range(func(k, _ any) bool {
			n++
			if !accepted[k.(string)] {
				t.Errorf("committed event %s was never accepted", k)
			}
			return true
		})
		if len(accepted) != n {
			t.Errorf("%d events accepted, %d committed: events of rolled-back transactions were delivered", len(accepted), n)
		}
		t.Logf("%s: %d events committed and accepted in order", e, n)
	})
}
