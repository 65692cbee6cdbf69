;;;; The memory budget: its arithmetic, a broadcast that costs its message
;;;; once, messages and bodies refused past it, and the demo under a small
;;;; heap against clients that never read and messages that never end.

(in-package #:hunchentoot-recycling-taskmaster-test)

(def-suite memory-budget :in all :description "One bound on what the engine holds for clients.")
(in-suite memory-budget)

;;; The arithmetic.

(test memory-budget.reserves-up-to-its-limit-and-counts-refusals
  (let ((budget (hrt::make-memory-budget 1000)))
    (is-true (hrt::reserve-memory budget 600))
    (is-false (hrt::reserve-memory budget 401) "past the limit: refused, nothing taken")
    (is (= 600 (hrt::memory-budget-used budget)))
    (is (= 1 (hrt::memory-budget-refusals budget)))
    (is-true (hrt::memory-budget-refusing-p budget) "an episode begun")
    (is-true (hrt::reserve-memory budget 400))
    (is-false (hrt::memory-budget-exceeded-p budget))
    (hrt::charge-memory budget 10)
    (is-true (hrt::memory-budget-exceeded-p budget) "what a handler made is counted over the limit")
    (is-false (hrt::end-memory-episode-if-relieved budget) "still above three quarters")
    (hrt::release-memory budget 600)
    (is-true (hrt::end-memory-episode-if-relieved budget))
    (is (= 1010 (hrt::memory-budget-peak budget)))))

(test memory-budget.counted-octets-given-back-by-their-last-holder
  (let* ((budget (hrt::make-memory-budget 1000))
         (counted (hrt::make-counted-octets budget 300)))
    (is (= 300 (hrt::memory-budget-used budget)))
    (is-true (hrt::hold-counted-octets counted))
    (hrt::let-go-of-counted-octets counted)
    (is (= 300 (hrt::memory-budget-used budget)) "one holder left")
    (hrt::let-go-of-counted-octets counted)
    (is (= 0 (hrt::memory-budget-used budget)))
    (is-false (hrt::hold-counted-octets counted) "never held again once given back")
    (is (null (hrt::make-counted-octets budget 1001)) "refused before it is made")))

;;; Over the wire, with a budget of the acceptor's own.

(test memory-budget.one-string-sent-to-many-clients-shares-one-frame
  (let* ((budget (hrt::make-memory-budget 100000))
         (message (make-string 1000 :initial-element #\a))
         (first (hrt::message-frame hrt::+text-opcode+ message budget))
         (second (hrt::message-frame hrt::+text-opcode+ message budget)))
    (is (eq first second) "the second send shares the first one's frame")
    (is (= 1004 (hrt::memory-budget-used budget)) "counted once")
    (setf (char message 0) #\b)
    (let ((third (hrt::message-frame hrt::+text-opcode+ message budget)))
      (is (not (eq first third)) "a string changed since is encoded again")
      (is (= (char-code #\b) (aref (hrt::counted-octets-octets third) 4))))
    (is (not (eq (hrt::message-frame hrt::+text-opcode+ (copy-seq message) budget)
                 (hrt::message-frame hrt::+text-opcode+ (copy-seq message) budget)))
        "another string of the same text is another message")))

(defun send-unfinished-message (socket length)
  "Send SOCKET's server all but the last octet of a text message of LENGTH
octets; true when the server took them all."
  (handler-case (progn (send-octets socket (frame 1 (make-array (1- length) :element-type '(unsigned-byte 8)
                                                                           :initial-element 120)
                                                  :length length))
                       t)
    (error () nil)))

(test memory-budget.unfinished-messages-past-the-budget-closed-1013-others-answered
  (let ((budget (* 4 1024 1024)))
    (with-server (server (websocket-server :memory-budget budget))
      (let ((sockets (loop repeat 12 collect (open-websocket server "/echo"))))
        (unwind-protect
             (progn
               (dolist (socket sockets)
                 (send-unfinished-message socket (* 1024 1024)))
               (is (wait-until (lambda () (plusp (or (cdr (assoc 1013 (stats server :websocket-closes))) 0))))
                   "a message the budget has no room for closes its client with 1013")
               (is (<= (stats server :memory-peak-bytes) budget) "reserved before it is made, never past it")
               (is (plusp (stats server :memory-refusals)))
               (let ((status (http-get server "/body-length"))) (is (eql 200 status) "a request needing no buffer is answered: ~A" status))
               ;; Once the maintenance thread has closed the largest holders.
               (is (wait-until (lambda () (< (stats server :memory-held-bytes) (* 3/4 budget)))))
               (with-websocket (socket server "/echo")
                 (send-frame socket 1 "still here")
                 (is (equal "still here" (read-text socket)) "so is a small message")))
          (mapc #'usocket:socket-close (remove nil sockets)))
        (is (wait-until (lambda () (zerop (stats server :open-websockets)))))
        (is (< (stats server :memory-held-bytes) 100)
            "every piece given back once the clients went (the last frame sent, of 12 octets, is kept): ~D held"
            (stats server :memory-held-bytes))))))

(test memory-budget.trickled-message-closed-at-the-message-timeout
  (with-server (server (websocket-server :websocket-message-timeout 2))
    (with-websocket (socket server "/echo")
      (let ((octets (frame 1 (make-array 100 :element-type '(unsigned-byte 8) :initial-element 120))))
        (send-octets socket (subseq octets 0 20))
        ;; An octet every 0.3 s is never silence, but the message never ends in time.
        (let ((code (loop for position from 20 below (length octets)
                          do (ignore-errors (send-octets socket (subseq octets position (1+ position))))
                             (let ((code (and (usocket:wait-for-input socket :timeout 0.3 :ready-only t)
                                              (read-close socket :timeout 1))))
                               (when code (return code))))))
          (is (eql 1008 code) "closed with 1008 while it still trickled"))))))

(test memory-budget.body-past-the-budget-goes-to-its-file
  (with-server (server (make-server 'parallel-easy-acceptor :memory-budget (* 1024 1024)
                                    :body-buffer-bytes (* 4 1024 1024)))
    (let ((body (make-string (* 2 1024 1024) :initial-element #\b)))
      (multiple-value-bind (status reply)
          (http-get server "/body-length" :method :post :content body :content-type "text/plain")
        (is (eql 200 status))
        (is (equal (princ-to-string (length body)) reply) "the handler read it whole"))
      (is (= 0 (stats server :memory-held-bytes)) "given back after the request"))))

(hunchentoot:define-easy-handler (body-length :uri "/body-length") ()
  (setf (hunchentoot:content-type*) "text/plain")
  (princ-to-string (length (hunchentoot:raw-post-data :force-binary t))))

;;; The demo, under a small heap.

(defun open-websocket-on-port (port path)
  "A socket whose websocket on PATH of the server on PORT is open, or NIL."
  (handler-case
      (let ((socket (connect-to-port port)))
        (send-text socket (websocket-handshake-text path))
        (if (eql 101 (read-reply-head socket))
            socket
            (progn (usocket:socket-close socket) nil)))
    (error () nil)))

(defun demo-statistic (port name)
  "The number the demo's /stats says for NAME, or NIL."
  (let ((text (ignore-errors (drakma:http-request (format nil "http://127.0.0.1:~D/stats" port)))))
    (and (stringp text)
         (let ((groups (nth-value 1 (cl-ppcre:scan-to-strings (format nil "(?m)^~A: (\\d+)" name) text))))
           (and groups (parse-integer (aref groups 0)))))))

(defun demo-status (port path)
  (nth-value 1 (ignore-errors (drakma:http-request (format nil "http://127.0.0.1:~D~A" port path)
                                                   :connection-timeout 5))))

(test memory-budget.demo-in-a-small-heap-survives-mute-clients-and-endless-messages
  (let* ((port (free-port))
         (log (format nil "~Amemory-demo.log" (make-scratch-folder)))
         (demo (launch-demo port log :dynamic-space-megabytes 256))
         (sockets '()))
    (is (not (null demo)) "the demo started with a 256 MB heap")
    (when demo
      (unwind-protect
           (let ((sender (open-websocket-on-port port "/ws/chat"))
                 (message (make-string 100000 :initial-element #\c)))
             (setf sockets (loop repeat 300 collect (open-websocket-on-port port "/ws/chat")))
             (push sender sockets)
             ;; 30 broadcasts of 100 KB to 300 clients that read nothing;
             ;; the sender reads each back.
             (is (= 30 (loop repeat 30
                             count (progn (send-frame sender 1 message)
                                          (equal message (read-text sender :timeout 30)))))
                 "the sender, which reads, has every message")
             ;; 150 messages of 1 MiB that never end: 150 MB past a 64 MB budget.
             (dotimes (i 150)
               (let ((socket (open-websocket-on-port port "/ws/echo")))
                 (when socket
                   (push socket sockets)
                   (send-unfinished-message socket (* 1024 1024)))))
             (is (uiop:process-alive-p demo) "the process is alive")
             (is (eql 200 (demo-status port "/yo")) "and answers")
             (is (plusp (or (demo-statistic port "memory-refusals") 0)) "the budget refused buffers")
             (is (<= (or (demo-statistic port "memory-peak-bytes") most-positive-fixnum)
                     (or (demo-statistic port "memory-budget-bytes") 0))
                 "what the budget held stayed under its limit")
             (let ((heap (demo-statistic port "heap-bytes")))
               (is (and heap (< heap (* 3/4 256 1024 1024))) "the heap holds ~A octets" heap)))
        (mapc (lambda (socket) (ignore-errors (usocket:socket-close socket))) (remove nil sockets))
        (stop-process demo)))))
