;;;; The engine floor: ours' pool and readiness engine -- threads sharing
;;;; one epoll set, one-shot arming, connections parked and taken up, the
;;;; pool's and the set's counts a request -- answering each request head
;;;; with the threaded floor's fixed reply (FLOOR-REPLY), through the
;;;; readiness set's face, as a turn of the request cycle would.  No HTTP is
;;;; parsed, no Hunchentoot request or reply made, no handler dispatched.
;;;; In the per-core table ours' fraction of it is what answering through
;;;; Hunchentoot's protocol leaves of the engine's speed; its fraction of
;;;; nginx, what the engine costs before any request is understood.
;;;;
;;;; It answers wrk's GETs kept alive only: a blank line ends each request.

(in-package #:hunchentoot-recycling-taskmaster-bench)

(defclass engine-floor-acceptor (hrt:parallel-acceptor)
  ()
  (:documentation "A parallel acceptor whose turns answer every request
head that has arrived with FLOOR-REPLY (ANSWER-FLOOR-TURN)."))

(defparameter *head-end-octets*
  (flex:string-to-octets (format nil "~C~C~C~C" #\Return #\Newline #\Return #\Newline) :external-format :latin-1)
  "What ends a request head of wrk's.")

(defparameter *engine-floor-reply* (floor-reply nil)
  "The reply to every request of the engine floor.")

(defun answer-floor-heads (serving connection end)
  "Answer each whole head among the END octets of SERVING's buffer, each
counted as a request by the pool and the readiness set as ours counts it;
move what follows the last to the buffer's start.  Its length, or NIL when
the client has gone."
  (let ((buffer (hrt::serving-buffer serving))
        (set (hrt::serving-set serving))
        (taskmaster (hrt::engine-taskmaster (hrt::serving-engine serving)))
        (worker (hrt::serving-worker serving))
        (start 0))
    (loop for head-end = (search *head-end-octets* buffer :start2 start :end2 end)
          while head-end
          do (hrt::note-request-started taskmaster worker)
             (let* ((sent (hrt::send-reply-without-waiting set connection *engine-floor-reply*
                                                          (length *engine-floor-reply*) nil nil))
                    (microseconds (hrt::note-request-finished taskmaster worker :answered sent)))
               (unless sent
                 (return-from answer-floor-heads nil))
               (hrt::note-answered-request set connection (hrt::serving-counter-stripe serving) 200 microseconds))
             (setf start (+ head-end (length *head-end-octets*))))
    (replace buffer buffer :start2 start :end2 end)
    (- end start)))

(defun answer-floor-turn (serving connection)
  "One turn on CONNECTION: read what has arrived, answer it; the turn's
outcome and its detail (readiness/face.lisp)."
  (let* ((buffer (hrt::serving-buffer serving))
         (end (hrt::take-pending-bytes connection buffer (hrt::serving-budget serving)))
         (count (hrt::receive-bytes connection buffer end (length buffer))))
    (cond ((eq count :would-block) (values :park end))
          ((or (eq count :error) (eql count 0)) :close)
          (t (let ((left (answer-floor-heads serving connection (+ end count))))
               (cond ((null left) :close)
                     ((hrt::follow-reply-rest-with connection :keep-alive) (values :send-rest left))
                     (t (values :park left))))))))

(defmethod hunchentoot:process-connection ((acceptor engine-floor-acceptor) (socket hrt::connection-socket))
  "A turn of the engine floor on the connection the calling worker holds,
then the connection parked or closed, as ours' own method does."
  (let* ((serving hrt::*serving*)
         (worker (hrt::serving-worker serving))
         (connection (hrt::worker-connection worker)))
    (multiple-value-bind (outcome detail) (answer-floor-turn serving connection)
      (when (hrt::let-go-of-connection worker)
        (hrt::end-turn (hrt::serving-set serving) connection (hrt::serving-buffer serving) outcome detail)))))

(defun serve-engine-floor (port)
  "Serve the engine floor on 127.0.0.1:PORT until killed."
  (start-hunchentoot port 'engine-floor-acceptor)
  (loop (sleep 3600)))

(defun launch-engine-floor (port delay-ms core log-file)
  "Start the engine floor (LAUNCH-FLOOR).  It has no handler to delay."
  (assert (zerop delay-ms) () "The engine floor answers 0 ms cells only.")
  (launch-floor (format nil "(hunchentoot-recycling-taskmaster-bench::serve-engine-floor ~D)" port) core log-file))

(defparameter *engine-floor-server*
  (list :name "engine-floor" :label "engine floor (ours without Hunchentoot's protocol)"
        :launch 'launch-engine-floor))
