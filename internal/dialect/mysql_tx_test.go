package dialect

import (
	"context"
	"database/sql"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

func TestMySQLClaimTransactionSeesWhatCommitsDuringIt(t *testing.T) {
	t.Parallel()
	db, _ := outboxtest.OpenMySQL(t, nil)
	noErr(t, db.Exec(`CREATE TABLE probe (id INT PRIMARY KEY) ENGINE = InnoDB`).Error)
	// Under REPEATABLE READ, the server's default, the second count would
	// repeat the first.
	var before, after int
	err := readCommittedTx(context.Background(), db, func(tx *sql.Tx) error {
		if err := tx.QueryRow(`SELECT count(*) FROM probe`).Scan(&before); err != nil {
			return err
		}
		if err := db.Exec(`INSERT INTO probe VALUES (1)`).Error; err != nil {
			return err
		}
		return tx.QueryRow(`SELECT count(*) FROM probe`).Scan(&after)
	})
	if err != nil {
		t.Fatal(err)
	}
	if before != 0 || after != 1 {
		t.Fatalf("counts %d then %d, want 0 then 1 (READ COMMITTED)", before, after)
	}
}

func TestMySQLClaimTransactionRunsAgainAfterADeadlock(t *testing.T) {
	t.Parallel()
	db, _ := outboxtest.OpenMySQL(t, nil)
	noErr(t, db.Exec(`CREATE TABLE probe (id INT PRIMARY KEY, n INT NOT NULL) ENGINE = InnoDB`).Error)
	noErr(t, db.Exec(`INSERT INTO probe VALUES (1, 0), (2, 0)`).Error)
	// Two transactions lock the rows in opposite orders, both waiting for
	// each other's first lock on their first run: the server ends one of
	// them, which runs again and then succeeds.
	var runs atomic.Int32
	var first sync.WaitGroup
	first.Add(2)
	cross := func(a, b int) error {
		return readCommittedTx(context.Background(), db, func(tx *sql.Tx) error {
			run := runs.Add(1)
			if _, err := tx.Exec(`UPDATE probe SET n = n + 1 WHERE id = ?`, a); err != nil {
				return err
			}
			if run <= 2 {
				first.Done()
				first.Wait()
			}
			_, err := tx.Exec(`UPDATE probe SET n = n + 1 WHERE id = ?`, b)
			return err
		})
	}
	errs := make(chan error, 2)
	go func() { errs <- cross(1, 2) }()
	go func() { errs <- cross(2, 1) }()
	for range 2 {
		if err := <-errs; err != nil {
			t.Fatalf("transaction failed: %v", err)
		}
	}
	if n := runs.Load(); n != 3 {
		t.Fatalf("%d runs, want 3 (one again after the deadlock)", n)
	}
	var sum int
	noErr(t, db.Raw(`SELECT sum(n) FROM probe`).Scan(&sum).Error)
	if sum != 4 {
		t.Fatalf("sum %d, want 4: each transaction counted once", sum)
	}
}

func noErr(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
