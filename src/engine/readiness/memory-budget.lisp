;;;; The memory budget: one bound on the octets the engine holds on behalf
;;;; of clients -- what waits for a client that reads slowly (the engine's
;;;; copies of the rest of a reply, websocket frames), websocket messages
;;;; that have partly arrived, request bodies kept in memory, heads that
;;;; have partly arrived.  Each such buffer is taken from the budget before
;;;; it is made (RESERVE-MEMORY) or, when the octets have come already,
;;;; counted as it is kept (CHARGE-MEMORY), and given back when it is let
;;;; go.  Octets a handler made are the application's, not counted.  So a client's
;;;; buffer is refused before the heap is exhausted, whatever the number of
;;;; clients: the budget is a share of the dynamic space, and SBCL's copying
;;;; collector needs as much again free to collect it.
;;;;
;;;; A buffer refused is work refused: a websocket whose message or frame
;;;; finds no room is closed 1013 (Try Again Later), a request body goes to
;;;; its file, and while what was counted as it came holds more than the
;;;; limit, new requests get 503.  A request that needs no buffer is answered as
;;;; ever.  An episode begins at the first refusal and lasts until what is
;;;; held falls below +MEMORY-RELIEF-SHARE+ of the limit; meanwhile the
;;;; sweeper closes the parked connections holding the most (closing.lisp).
;;;; One log line an episode, every refusal counted.  What is given back
;;;; is exactly what was taken, by the holder that took it: a count that
;;;; went below zero would wrap, and refuse every request.
;;;;
;;;; COUNTED-OCTETS are octets many holders share, charged once: a frame
;;;; broadcast to every client of a chat waits in each one's queue as the
;;;; same vector, and is given back when the last queue lets go of it.
;;;;
;;;; Locking: none.  USED and the counts are atomic words; EPISODE changes
;;;; by compare-and-swap, so that one thread logs its beginning.

(in-package #:hunchentoot-recycling-taskmaster)

(defconstant +memory-relief-share+ 3/4
  "The share of its limit a budget's use must fall below to end an episode.")

(defstruct (memory-budget (:constructor make-memory-budget (limit)))
  "The octets one engine (or every engine of the process sharing it) may
hold on behalf of clients."
  ;; The octets it may hold.
  (limit 0 :type word :read-only t)
  ;; The octets held now: reserved, or charged and not given back yet.
  (used 0 :type word)
  ;; The most USED has been, as last seen by a reservation.
  (peak 0 :type word)
  ;; Reservations refused for want of room, ever: a buffer not made, a
  ;; request answered 503, a websocket closed 1013.
  (refusals 0 :type word)
  ;; Connections closed to bring USED back under the limit, ever.
  (relief-closes 0 :type word)
  ;; NIL while the budget has room; :BEGUN at the first refusal; :LOGGED
  ;; once the episode's log line is written.
  (episode nil))

(defmethod print-object ((budget memory-budget) stream)
  (print-unreadable-object (budget stream :type t :identity t)
    (format stream "~D of ~D octets" (memory-budget-used budget) (memory-budget-limit budget))))

(defvar *process-memory-budget* nil
  "The budget every acceptor of the process shares unless it is given its
own (:MEMORY-BUDGET): made at the first start, a quarter of the dynamic space.")

(defun process-memory-budget ()
  "The process's shared MEMORY-BUDGET, made at the first call."
  (or *process-memory-budget*
      (let ((budget (make-memory-budget (floor (sb-ext:dynamic-space-size) 4))))
        (if (compare-and-swap (symbol-value '*process-memory-budget*) nil budget)
            budget
            *process-memory-budget*))))

(defun note-memory-peak (budget used)
  (loop for peak = (memory-budget-peak budget)
        while (> used peak)
        until (compare-and-swap (memory-budget-peak budget) peak used)))

(defun begin-memory-episode (budget)
  (compare-and-swap (memory-budget-episode budget) nil :begun))

(defun reserve-memory (budget octets &key input-p)
  "Take OCTETS from BUDGET before a buffer of them is made.  True when they
fit under its limit -- strictly under +MEMORY-RELIEF-SHARE+ of it for a
client's INPUT-P octets, so that clients sending what never ends cannot
leave no room for what is sent to the others; false, with nothing taken
and the refusal counted (an episode begun), when they do not."
  (let ((used (+ (atomic-add (memory-budget-used budget) octets) octets)))
    (cond ((if input-p
               (< used (* +memory-relief-share+ (memory-budget-limit budget)))
               (<= used (memory-budget-limit budget)))
           (note-memory-peak budget used)
           t)
          (t (atomic-subtract (memory-budget-used budget) octets)
             (atomic-increment (memory-budget-refusals budget))
             (begin-memory-episode budget)
             nil))))

(defun charge-memory (budget octets)
  "Count OCTETS made already (the engine's copy of a reply, a head that
arrived), now kept on a client's behalf, against BUDGET, over its limit if
need be (which begins an episode)."
  (let ((used (+ (atomic-add (memory-budget-used budget) octets) octets)))
    (note-memory-peak budget used)
    (when (> used (memory-budget-limit budget))
      (begin-memory-episode budget))))

(defun release-memory (budget octets)
  "Give OCTETS reserved or charged back to BUDGET."
  (atomic-subtract (memory-budget-used budget) octets))

(defun memory-budget-refusing-p (budget)
  "True during an episode."
  (not (null (memory-budget-episode budget))))

(defun memory-budget-exceeded-p (budget)
  "True while BUDGET holds more than its limit (copies of replies and heads
counted as they came): new requests are refused."
  (> (memory-budget-used budget) (memory-budget-limit budget)))

(defun memory-relieved-p (budget)
  "True when BUDGET's use is below +MEMORY-RELIEF-SHARE+ of its limit."
  (< (memory-budget-used budget) (* +memory-relief-share+ (memory-budget-limit budget))))

(defun end-memory-episode-if-relieved (budget)
  "End BUDGET's episode when its use has fallen far enough.  True when it ended one."
  (let ((episode (memory-budget-episode budget)))
    (and episode (memory-relieved-p budget)
         (compare-and-swap (memory-budget-episode budget) episode nil))))

(defun claim-memory-episode-log (budget)
  "True for the one caller that is to log the episode begun."
  (compare-and-swap (memory-budget-episode budget) :begun :logged))

;;; Octets shared by several holders.

(defstruct (counted-octets (:constructor %make-counted-octets (octets budget)))
  "OCTETS charged to BUDGET once, however many hold them: given back when
the last holder lets go."
  (octets nil :type octets :read-only t)
  ;; The MEMORY-BUDGET they were taken from, or NIL when uncounted.
  (budget nil :read-only t)
  ;; The holders now; 0 once given back, never held again.
  (holders 1 :type word))

(defun make-counted-octets (budget length)
  "Fresh COUNTED-OCTETS of LENGTH, held once, reserved from BUDGET first;
NIL when BUDGET has no room for them."
  (when (reserve-memory budget length)
    (%make-counted-octets (make-array length :element-type '(unsigned-byte 8)) budget)))

(defun charged-octets (octets budget)
  "OCTETS, made already, as COUNTED-OCTETS held once, charged to BUDGET
(CHARGE-MEMORY): what a library made that must be kept."
  (charge-memory budget (length octets))
  (%make-counted-octets octets budget))

(defun uncounted-octets (octets)
  "OCTETS as COUNTED-OCTETS held once and counted in no budget: a control
frame of at most 127 octets, one or two a connection."
  (%make-counted-octets octets nil))

(defun hold-counted-octets (counted)
  "One more holder of COUNTED.  False when it was given back already."
  (loop for holders = (counted-octets-holders counted)
        do (cond ((zerop holders) (return nil))
                 ((compare-and-swap (counted-octets-holders counted) holders (1+ holders)) (return t)))))

(defun let-go-of-counted-octets (counted)
  "One holder fewer of COUNTED; the last gives its octets back to the budget."
  (when (and (= 1 (atomic-decrement (counted-octets-holders counted)))
             (counted-octets-budget counted))
    (release-memory (counted-octets-budget counted) (length (counted-octets-octets counted)))))
